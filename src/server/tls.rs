//! TLS of the ext_proc port: the rustls configuration built from [`GrpcTls`], and the stream of
//! accepted connections the gRPC server reads.
//!
//! Invariants: mode `self-signed` generates a fresh key and certificate in memory at each start
//! (nothing is written to disk, so a read-only root filesystem is fine); mode `files` reads the PEM
//! files at start and again on [`Acceptor::reload`] (a rotated Secret: new connections get the new
//! certificate, open ones keep theirs; material that fails to load leaves the old in place); a
//! client CA makes client certificates mandatory. Unreadable or invalid
//! material stops the start with a message naming the file. Each connection is told apart by its
//! first byte (a TLS record starts with 0x16, an HTTP/2 preface with `P`) and handshaken on its own
//! task, bounded by [`HANDSHAKE_TIMEOUT`], so a slow or silent client never holds up the others; a
//! refused plaintext connection or a failed handshake is closed, logged and counted.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::config::{GrpcTls, TlsMode};

/// Pause after a failed `accept` (out of file descriptors, and the like) before the next: the
/// error usually persists for a while, and retrying at once would spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Names the generated certificate is valid for (proxies do not verify it; these help `openssl
/// s_client` users and clients that do).
const SELF_SIGNED_NAMES: [&str; 4] = ["kvepp", "localhost", "127.0.0.1", "::1"];

/// Longest wait for a connection's first byte and for its TLS handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// First byte of a TLS handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: io::Error,
    },
    #[error("{what} {path}: {message}")]
    Invalid {
        what: &'static str,
        path: String,
        message: String,
    },
    #[error("cannot generate the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

fn read(what: &'static str, path: Option<&Path>) -> Result<Vec<u8>, TlsError> {
    let path = path.unwrap_or(Path::new(""));
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.display().to_string(),
        source,
    })
}

fn certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, Some(path))?;
    let invalid = |message: String| TlsError::Invalid {
        what,
        path: path.display().to_string(),
        message,
    };
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(e.to_string()))?;
    if certs.is_empty() {
        return Err(invalid("no PEM certificate in it".into()));
    }
    Ok(certs)
}

/// How the ext_proc port accepts connections.
#[derive(Clone)]
pub struct Acceptor {
    /// The TLS configuration new connections are handshaken with (replaced on a reload).
    tls: Option<Arc<arc_swap::ArcSwap<rustls::ServerConfig>>>,
    accept_plaintext: bool,
    refused: Counter,
}

impl std::fmt::Debug for Acceptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor")
            .field("tls", &self.tls.is_some())
            .field("accept_plaintext", &self.accept_plaintext)
            .finish()
    }
}

impl Acceptor {
    /// The acceptor `tls` describes; refused connections and failed handshakes count in `refused`.
    pub(crate) fn new(tls: &GrpcTls, refused: Counter) -> Result<Acceptor, TlsError> {
        Ok(Acceptor {
            tls: server_config(tls)?.map(|c| Arc::new(arc_swap::ArcSwap::from_pointee(c))),
            accept_plaintext: tls.accept_plaintext || tls.mode == TlsMode::Off,
            refused,
        })
    }

    /// Reads mode `files`' certificate, key and client CA again: new connections get them.
    /// Ok(false): nothing to re-read (mode `self-signed` or `off`); an error leaves the material
    /// in use as it was.
    pub(crate) fn reload(&self, tls: &GrpcTls) -> Result<bool, TlsError> {
        match (&self.tls, tls.mode) {
            (Some(current), TlsMode::Files) => {
                if let Some(c) = server_config(tls)? {
                    current.store(Arc::new(c));
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// The rustls configuration `tls` describes (None: mode `off`).
fn server_config(tls: &GrpcTls) -> Result<Option<rustls::ServerConfig>, TlsError> {
    let (chain, key) = match tls.mode {
        TlsMode::Off => return Ok(None),
        TlsMode::SelfSigned => {
            let names: Vec<String> = SELF_SIGNED_NAMES.iter().map(|s| s.to_string()).collect();
            let ck = rcgen::generate_simple_self_signed(names)?;
            let key = PrivateKeyDer::Pkcs8(ck.signing_key.serialize_der().into());
            (vec![ck.cert.der().clone()], key)
        }
        TlsMode::Files => {
            let cert_path = tls.cert_file.as_deref().unwrap_or(Path::new(""));
            let key_path = tls.key_file.as_deref().unwrap_or(Path::new(""));
            let pem = read("TLS key", Some(key_path))?;
            let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsError::Invalid {
                what: "TLS key",
                path: key_path.display().to_string(),
                message: e.to_string(),
            })?;
            (certs("TLS certificate", cert_path)?, key)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match &tls.client_ca_file {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certs("client CA bundle", ca)? {
                roots.add(c)?;
            }
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| TlsError::Invalid {
                        what: "client CA bundle",
                        path: ca.display().to_string(),
                        message: e.to_string(),
                    })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Some(config))
}

impl Acceptor {
    /// One accepted TCP connection, classified and (for TLS) handshaken.
    async fn accept(&self, tcp: TcpStream) -> Result<Conn, String> {
        let mut first = [0u8; 1];
        let n = tokio::time::timeout(HANDSHAKE_TIMEOUT, tcp.peek(&mut first))
            .await
            .map_err(|_| "no first byte in time".to_string())?
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("closed before sending anything".into());
        }
        match (&self.tls, first[0] == TLS_HANDSHAKE_RECORD) {
            (Some(tls), true) => tokio::time::timeout(
                HANDSHAKE_TIMEOUT,
                TlsAcceptor::from(tls.load_full()).accept(tcp),
            )
            .await
            .map_err(|_| "TLS handshake timed out".to_string())?
            .map(|s| Conn::Tls(Box::new(s)))
            .map_err(|e| format!("TLS handshake failed: {e}")),
            (None, true) => {
                Err("TLS client, but the port serves plaintext (grpc_tls.mode off)".into())
            }
            (_, false) if self.accept_plaintext => Ok(Conn::Plain(tcp)),
            (_, false) => {
                Err("plaintext client refused (grpc_tls.accept_plaintext is false)".into())
            }
        }
    }

    /// The connections of `listener`, ready for the gRPC server; ends when the server stops
    /// reading it.
    pub(crate) fn incoming(
        self,
        listener: TcpListener,
    ) -> impl tokio_stream::Stream<Item = io::Result<Conn>> {
        let (tx, rx) = mpsc::channel::<io::Result<Conn>>(64);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = tx.closed() => return,
                };
                let tcp = match accepted {
                    Ok((tcp, _)) => tcp,
                    Err(e) => {
                        // Out of file descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "ext_proc accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                // Small ext_proc messages must not wait for Nagle + delayed ACK.
                let _ = tcp.set_nodelay(true);
                let peer = tcp.peer_addr().ok();
                let this = self.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match this.accept(tcp).await {
                        Ok(conn) => {
                            let _ = tx.send(Ok(conn)).await;
                        }
                        Err(why) => {
                            this.refused.inc();
                            tracing::warn!(peer = ?peer, "ext_proc connection closed: {why}");
                        }
                    }
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}

/// An accepted ext_proc connection.
#[derive(Debug)]
pub enum Conn {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            Conn::Plain(s) => s.connect_info(),
            Conn::Tls(s) => s.get_ref().0.connect_info(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(s) => s.is_write_vectored(),
            Conn::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
