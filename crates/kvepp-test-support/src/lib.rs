//! What kvepp's tests, benchmarks and demos need around the EPP: temporary directories, an echo
//! backend standing in for a model server, a small HTTP/1.1 client, a real Envoy process, real
//! vLLM engines, waiting for a condition with a deadline, and reading one Prometheus sample.
//!
//! Used as a dev-dependency of every package's tests (and by the simulator and the benchmark
//! drivers for its HTTP client and trace reader). Without
//! features it does not depend on `kvepp`; `epp` adds kvepp in-process (`epp::Epp`) and the
//! shipped manifests as kvepp reads them (`shipped`), `kube` a real etcd and kube-apiserver
//! (`kube_cluster`), `otlp` a trace collector (`otlp`), `tls` certificates and a TLS ext_proc
//! client (`tls`). The fixtures beyond those: the benchmarks' workload traces ([`trace`]), a
//! network namespace whose pod addresses are local ([`pod_network`]), a fake Kubernetes API
//! server at the wire level for what a real one cannot show ([`kube_api`]), a pyzmq KV-event publisher
//! ([`publisher`]), what a test reaches for first ([`harness`]), and all of it in one import ([`prelude`]).
// Test support: a helper that cannot do its job fails the test that called it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod client;
pub mod container;
pub mod envoy;
#[cfg(feature = "epp")]
pub mod epp;
pub mod harness;
pub mod kube_api;
#[cfg(feature = "kube")]
pub mod kube_cluster;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod pod_network;
pub mod prelude;
pub mod publisher;
#[cfg(feature = "epp")]
pub mod shipped;
#[cfg(feature = "tls")]
pub mod tls;
pub mod trace;
pub mod vllm;

use std::future::Future;
use std::time::Duration;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::IntoResponse;
use tokio::net::TcpListener;

/// A directory removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "kvepp-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("create {}: {e}", p.display()));
        TempDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// FNV-1a 64 of a body: lets a test check bytes arrived unchanged without echoing them.
pub fn fnv64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    })
}

/// Serves an HTTP backend that answers every request with a JSON description of what it received
/// and who it is (the stand-in for a model server in tests and the demo).
pub async fn serve_echo_backend(listener: TcpListener, name: String) -> std::io::Result<()> {
    let app = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let name = name.clone();
            async move { echo(&name, method, uri, headers, body) }
        },
    );
    axum::serve(listener, app).await
}

/// Starts an echo backend on 127.0.0.1 with an ephemeral port.
pub async fn spawn_echo_backend(name: &str) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(serve_echo_backend(listener, name.to_owned()));
    Ok(addr)
}

fn echo(
    name: &str,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let header = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let model = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("model")?.as_str().map(str::to_owned));
    let reply = serde_json::json!({
        "backend": name,
        "method": method.as_str(),
        "path": uri.path(),
        "model": model,
        "body_len": body.len(),
        "body_fnv": format!("{:016x}", fnv64(&body)),
        "content_length": header("content-length"),
        "transfer_encoding": header("transfer-encoding"),
        "destination": header("x-gateway-destination-endpoint"),
        "scores": header("x-gateway-destination-endpoint-scores"),
        "traceparent": header("traceparent"),
    });
    // A model named `unserved…` is one this backend does not serve: 404, as an engine answers.
    let status = match model.as_deref() {
        Some(m) if m.starts_with("unserved") => axum::http::StatusCode::NOT_FOUND,
        _ => axum::http::StatusCode::OK,
    };
    (
        status,
        [
            ("content-type", "application/json".to_owned()),
            ("x-backend", name.to_owned()),
        ],
        reply.to_string(),
    )
}

/// Polls `probe` every 20 ms until it yields a value or `deadline` passes.
pub async fn wait_until<T, F, Fut>(
    what: &str,
    deadline: Duration,
    mut probe: F,
) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        if let Some(v) = probe().await {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= end {
            return Err(format!("{what}: not within {deadline:?}"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the sample whose series text (name and labels, as exposed) is exactly `series`, in a
/// Prometheus/OpenMetrics text page.
pub fn find_sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}
