//! Who may talk to kvepp: TLS on the ext_proc port (self-signed by default, mounted files, mutual
//! TLS), plaintext refused when asked, loopback binds for the admin ports, and the bearer token in
//! front of `/debug/*` and the HTTP services' write routes.

use kvepp_test_support::tls;

use std::net::SocketAddr;

use kvepp::config::TlsMode;
use kvepp_test_support::prelude::*;
use tls::*;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

fn manifests(backend: SocketAddr) -> String {
    pool_manifests(&[("a", backend)])
}

#[tokio::test]
async fn ext_proc_is_tls_by_default_and_envoy_routes_over_it() {
    let backends = echo_backends(&["a"]).await;
    // TLS only: a plaintext client is refused, so a routed request proves Envoy spoke TLS.
    let epp = Epp::start(&manifests(backends[0]), |c| {
        assert_eq!(c.grpc_tls.mode, TlsMode::SelfSigned, "the default");
        c.grpc_tls.accept_plaintext = false;
    })
    .await;
    let err = plaintext(epp.grpc).await.unwrap_err();
    assert!(!err.is_empty());
    let refused = || async { epp.metric("kvepp_grpc_connections_refused_total").await };
    wait_for("refusal counted", || async {
        (refused().await >= Some(1.0)).then_some(())
    })
    .await;

    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let r = http(
        envoy.addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        r#"{"model":"m","prompt":"hello"}"#,
    )
    .await;
    assert_eq!(
        r.status,
        200,
        "{} {}",
        String::from_utf8_lossy(&r.body),
        envoy.log()
    );
    assert_eq!(r.json()["backend"], "a");
    let (_, stats) = kvepp_test_support::client::fetch(
        envoy.admin,
        "/stats?filter=^cluster.kvepp.ssl.handshake$",
    )
    .await
    .unwrap();
    let handshakes: u64 = stats
        .trim()
        .rsplit(' ')
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!(handshakes >= 1, "Envoy's TLS handshakes to kvepp: {stats}");
    epp.stop().await;
}

#[tokio::test]
async fn plaintext_and_tls_share_the_port_unless_refused() {
    let backends = echo_backends(&["a"]).await;
    let epp = Epp::start(&manifests(backends[0]), |_| {}).await;
    // Default: self-signed TLS, and h2c still served for proxies configured for it.
    plaintext(epp.grpc).await.unwrap();
    // A client that verifies the certificate against the system roots rejects the self-signed one.
    let strict = over_tls(epp.grpc, ClientTlsConfig::new().domain_name("localhost")).await;
    assert!(
        strict.is_err(),
        "a self-signed certificate passed verification"
    );
    epp.stop().await;

    let off = Epp::start(&manifests(backends[0]), |c| c.grpc_tls.mode = TlsMode::Off).await;
    plaintext(off.grpc).await.unwrap();
    off.stop().await;
}

#[tokio::test]
async fn mutual_tls_with_mounted_certificates() {
    let backends = echo_backends(&["a"]).await;
    let dir = kvepp_test_support::TempDir::new("pki");
    let pki = write_pki(dir.path());
    let p = |f: &str| Some(dir.path().join(f));
    let epp = Epp::start(&manifests(backends[0]), |c| {
        c.grpc_tls.mode = TlsMode::Files;
        c.grpc_tls.cert_file = p("server.pem");
        c.grpc_tls.key_file = p("server-key.pem");
        c.grpc_tls.client_ca_file = p("ca.pem");
        c.grpc_tls.accept_plaintext = false;
    })
    .await;
    let trust = || {
        ClientTlsConfig::new()
            .domain_name("localhost")
            .ca_certificate(Certificate::from_pem(&pki.ca))
    };
    let with_cert = trust().identity(Identity::from_pem(&pki.client_cert, &pki.client_key));
    over_tls(epp.grpc, with_cert).await.unwrap();
    let without = over_tls(epp.grpc, trust()).await;
    assert!(without.is_err(), "served a client without a certificate");
    assert!(plaintext(epp.grpc).await.is_err(), "served plaintext");
    epp.stop().await;
}

#[test]
fn tls_settings_are_checked_at_start() {
    let cfg = |t: kvepp::config::GrpcTls| kvepp::config::Config {
        pool_name: "p".into(),
        grpc_tls: t,
        ..Default::default()
    };
    let errs = |t| {
        cfg(t)
            .validate()
            .unwrap_err()
            .iter()
            .map(|e| format!("{}: {}", e.field, e.message))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let files = kvepp::config::GrpcTls {
        mode: TlsMode::Files,
        ..Default::default()
    };
    assert!(errs(files).contains("needs cert_file and key_file"));
    let mtls_plain = kvepp::config::GrpcTls {
        client_ca_file: Some("/etc/hostname".into()),
        ..Default::default()
    };
    assert!(errs(mtls_plain).contains("accept_plaintext: false"));
    let off_refusing = kvepp::config::GrpcTls {
        mode: TlsMode::Off,
        accept_plaintext: false,
        ..Default::default()
    };
    assert!(errs(off_refusing).contains("mode off"));
    assert!(cfg(Default::default()).validate().is_ok());
}

#[tokio::test]
async fn admin_ports_bind_loopback_unless_told_otherwise() {
    let cfg = kvepp::config::Config {
        bind_address: std::net::Ipv4Addr::UNSPECIFIED.into(),
        grpc_port: 0,
        grpc_health_port: 0,
        metrics_port: 0,
        select_service_port: Some(0),
        slot_tracker_port: Some(0),
        pool_name: "p".into(),
        ..Default::default()
    };
    let l = kvepp::server::Listeners::bind(&cfg).await.unwrap();
    let [grpc, health, metrics] = l.addrs().map(Option::unwrap);
    assert!(
        grpc.ip().is_unspecified(),
        "ext_proc must be reachable by the proxy"
    );
    for a in [
        health,
        metrics,
        l.doors.select.as_ref().unwrap().local_addr().unwrap(),
        l.doors.slots.as_ref().unwrap().local_addr().unwrap(),
    ] {
        assert!(a.ip().is_loopback(), "{a} is not loopback");
    }
}

async fn status(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> HttpResponse {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    http(addr, method, path, &headers, body.to_string()).await
}

fn assert_refused(r: &HttpResponse, what: &str) {
    assert_eq!(
        r.status,
        401,
        "{what}: {}",
        String::from_utf8_lossy(&r.body)
    );
    assert!(
        r.json()["error"].as_str().unwrap().contains("Bearer"),
        "{what}"
    );
    assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{what}");
}

#[tokio::test]
async fn bearer_token_guards_debug_and_write_routes() {
    let backends = echo_backends(&["a"]).await;
    let dir = kvepp_test_support::TempDir::new("token");
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t0ken-value\n").unwrap();
    let epp = Epp::start(&manifests(backends[0]), |c| {
        c.api_token_file = Some(token_file.clone());
        c.select_service_port = Some(0);
        c.slot_tracker_port = Some(0);
    })
    .await;
    let m = epp.metrics;
    for bad in [None, Some("wrong"), Some("t0ken-valu")] {
        assert_refused(&status(m, "GET", "/debug/kv-index", bad, "").await, "debug");
    }
    assert_eq!(
        status(m, "GET", "/debug/kv-index", Some("t0ken-value"), "")
            .await
            .status,
        200
    );
    assert_eq!(status(m, "GET", "/metrics", None, "").await.status, 200);
    assert_eq!(status(m, "GET", "/ready", None, "").await.status, 200);

    let sel = epp.select_service.unwrap();
    let worker = r#"{"worker_id": 7, "block_size": 16}"#;
    assert_refused(
        &status(sel, "POST", "/workers", None, worker).await,
        "select write",
    );
    let with = status(sel, "POST", "/workers", Some("t0ken-value"), worker).await;
    assert_ne!(with.status, 401, "{}", String::from_utf8_lossy(&with.body));
    assert_eq!(
        status(sel, "GET", "/workers", None, "").await.status,
        200,
        "reads stay open"
    );

    let slots = epp.slot_tracker.unwrap();
    let free = r#"{"request_id": "r1"}"#;
    assert_refused(
        &status(slots, "POST", "/free", None, free).await,
        "slot tracker write",
    );
    let with = status(slots, "POST", "/free", Some("t0ken-value"), free).await;
    assert_ne!(with.status, 401, "{}", String::from_utf8_lossy(&with.body));
    assert_eq!(status(slots, "GET", "/workers", None, "").await.status, 200);
    assert_eq!(
        epp.metric("kvepp_http_unauthorized_requests_total").await,
        Some(5.0)
    );
    epp.stop().await;
}
