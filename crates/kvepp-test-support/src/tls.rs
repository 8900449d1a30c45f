//! TLS helpers shared by the tests: a throwaway PKI written as PEM files, and one ext_proc
//! exchange over plaintext or TLS (Ok when kvepp answered).
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Req, HttpHeaders, ProcessingRequest,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair,
};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

use crate::harness::DEADLINE;

/// One ext_proc exchange (request headers with end of stream) over `channel`: Ok when kvepp
/// answered, Err with the reason otherwise.
pub async fn one_exchange(channel: Result<Channel, tonic::transport::Error>) -> Result<(), String> {
    let channel = channel.map_err(|e| format!("connect: {e:?}"))?;
    let mut client = ExternalProcessorClient::new(channel);
    let hdr = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        raw_value: v.as_bytes().to_vec(),
        ..Default::default()
    };
    let msg = ProcessingRequest {
        request: Some(Req::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![hdr(":method", "GET"), hdr(":path", "/v1/models")],
            }),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut stream = client
        .process(tokio_stream::iter([msg]))
        .await
        .map_err(|e| format!("process: {e:?}"))?
        .into_inner();
    match tokio::time::timeout(DEADLINE, stream.message()).await {
        Ok(Ok(Some(_))) => Ok(()),
        other => Err(format!("no answer: {other:?}")),
    }
}

pub fn endpoint(scheme: &str, addr: SocketAddr) -> Endpoint {
    Endpoint::from_shared(format!("{scheme}://localhost:{}", addr.port()))
        .expect("test PKI")
        .connect_timeout(std::time::Duration::from_secs(5))
}

pub async fn plaintext(addr: SocketAddr) -> Result<(), String> {
    one_exchange(endpoint("http", addr).connect().await).await
}

pub async fn over_tls(addr: SocketAddr, tls: ClientTlsConfig) -> Result<(), String> {
    match endpoint("https", addr).tls_config(tls) {
        Ok(e) => one_exchange(e.connect().await).await,
        Err(e) => Err(format!("tls config: {e}")),
    }
}

/// A CA, a server certificate for `localhost` and a client certificate it signed, as PEM files.
pub struct Pki {
    pub ca: String,
    pub client_cert: String,
    pub client_key: String,
}

pub fn write_pki(dir: &Path) -> Pki {
    let mut ca_params =
        CertificateParams::new(vec!["kvepp test CA".to_string()]).expect("test PKI");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().expect("test PKI"))
        .expect("test PKI");
    let leaf = |name: &str, usage: ExtendedKeyUsagePurpose| {
        let mut p = CertificateParams::new(vec![name.to_string()]).expect("test PKI");
        p.extended_key_usages = vec![usage];
        let key = KeyPair::generate().expect("test PKI");
        let cert = p.signed_by(&key, &ca).expect("test PKI");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf("localhost", ExtendedKeyUsagePurpose::ServerAuth);
    let (client_cert, client_key) = leaf("envoy", ExtendedKeyUsagePurpose::ClientAuth);
    for (f, text) in [
        ("ca.pem", ca.pem()),
        ("server.pem", server_cert),
        ("server-key.pem", server_key),
    ] {
        std::fs::write(dir.join(f), text).expect("test PKI");
    }
    Pki {
        ca: ca.pem(),
        client_cert,
        client_key,
    }
}
