//! What kvepp learns from the model servers themselves: the load signals they publish on their
//! Prometheus `/metrics` ([`metrics`]), their `/metadata` documents ([`metadata`]), and a small HTTP
//! GET client shared by both.

pub(crate) mod exposition;
pub mod lora;
pub(crate) mod metadata;
pub mod metrics;

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("connect {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("GET {path}: {0}", path = .1)]
    Http(String, String),
    #[error("GET {path}: status {status}")]
    Status { path: String, status: u16 },
    #[error("GET {path}: no answer within {timeout:?}")]
    Timeout { path: String, timeout: Duration },
}

/// How a server speaks HTTP (an InferencePool's `appProtocol` for its engines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HttpVersion {
    /// HTTP/1.1.
    #[default]
    Http1,
    /// HTTP/2 over cleartext with prior knowledge (`kubernetes.io/h2c`).
    H2c,
}

/// `GET http://addr/path` over HTTP/1.1 on a fresh connection, body at most `limit` bytes, all
/// within `timeout`.
pub(crate) async fn get(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    limit: usize,
) -> Result<Bytes, FetchError> {
    get_with(HttpVersion::Http1, addr, path, timeout, limit).await
}

/// [`get`] in the given HTTP version.
pub(crate) async fn get_with(
    version: HttpVersion,
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
    limit: usize,
) -> Result<Bytes, FetchError> {
    let fetch = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|source| FetchError::Connect { addr, source })?;
        let io = hyper_util::rt::TokioIo::new(stream);
        let http = |e: hyper::Error| FetchError::Http(e.to_string(), path.to_owned());
        let resp = match version {
            HttpVersion::Http1 => {
                let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                    .await
                    .map_err(http)?;
                tokio::spawn(conn);
                let req = hyper::Request::get(path)
                    .header("host", addr.to_string())
                    .body(Empty::<Bytes>::new())
                    .map_err(|e| FetchError::Http(e.to_string(), path.to_owned()))?;
                sender.send_request(req).await.map_err(http)?
            }
            HttpVersion::H2c => {
                let (mut sender, conn) =
                    hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
                        .await
                        .map_err(http)?;
                tokio::spawn(conn);
                let req = hyper::Request::get(format!("http://{addr}{path}"))
                    .body(Empty::<Bytes>::new())
                    .map_err(|e| FetchError::Http(e.to_string(), path.to_owned()))?;
                sender.send_request(req).await.map_err(http)?
            }
        };
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(FetchError::Status {
                path: path.to_owned(),
                status,
            });
        }
        Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .map_err(|e| FetchError::Http(e.to_string(), path.to_owned()))
    };
    tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| FetchError::Timeout {
            path: path.to_owned(),
            timeout,
        })?
}

/// The engines' counters, registered by the engine readers themselves (`metrics::Register`):
/// failed `/metrics` scrapes, endpoints whose `/metadata` cannot be fetched.
#[derive(Debug, Clone, Default)]
pub struct EngineCounters {
    pub scrape_errors: prometheus_client::metrics::counter::Counter,
    /// Pages whose `vllm:lora_requests_info` could not be read.
    pub lora_info_malformed: prometheus_client::metrics::counter::Counter,
    /// 1 for the engine kind each endpoint's metrics page showed.
    pub engine_kind: prometheus_client::metrics::family::Family<
        EngineKindLabels,
        prometheus_client::metrics::gauge::Gauge,
    >,
    pub metadata_missing: prometheus_client::metrics::family::Family<
        crate::metrics::EndpointLabels,
        prometheus_client::metrics::gauge::Gauge,
    >,
    /// Each endpoint's own prefix-cache hit ratio, as its engine reports it.
    pub prefix_cache_hit_ratio: prometheus_client::metrics::family::Family<
        crate::metrics::EndpointLabels,
        prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
    >,
}

/// An endpoint and the engine kind its metrics page showed (`vllm` or `sglang`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, prometheus_client::encoding::EncodeLabelSet)]
pub struct EngineKindLabels {
    pub endpoint: std::sync::Arc<str>,
    pub engine: &'static str,
}

impl crate::metrics::Register for EngineCounters {
    fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "engine_kind",
            "1 for the engine kind (vllm or sglang) of each endpoint: from its /metrics page, its /server_info, or engine_metrics.engine",
            self.engine_kind.clone(),
        );
        registry.register(
            "engine_metrics_scrape_errors",
            "Failed scrapes of engines' /metrics (unreachable, not 200, or neither vLLM's nor SGLang's series)",
            self.scrape_errors.clone(),
        );
        registry.register(
            "engine_lora_info_malformed",
            "Scraped pages whose vllm:lora_requests_info labels could not be read (the endpoint's last known adapters kept)",
            self.lora_info_malformed.clone(),
        );
        registry.register(
            "engine_prefix_cache_hit_ratio",
            "Each endpoint's prefix-cache hit ratio as its engine reports it (vLLM: prefix_cache_hits_total / prefix_cache_queries_total since it started; SGLang: sglang:cache_hit_rate)",
            self.prefix_cache_hit_ratio.clone(),
        );
        registry.register(
            "endpoint_metadata_missing",
            "1 while an endpoint's /metadata cannot be fetched (routed with defaults)",
            self.metadata_missing.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An h2c-only server (HTTP/2 with prior knowledge): the HTTP/1.1 GET fails, the h2c one
    /// gets the page.
    #[tokio::test]
    async fn h2c_engines_are_fetched_over_http2() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let svc = hyper::service::service_fn(
                    |req: hyper::Request<hyper::body::Incoming>| async move {
                        let body = format!("version {:?} path {}", req.version(), req.uri().path());
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(Bytes::from(body)),
                        ))
                    },
                );
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), svc),
                );
            }
        });
        let t = Duration::from_secs(5);
        let page = get_with(HttpVersion::H2c, addr, "/metrics", t, 1024)
            .await
            .unwrap();
        assert_eq!(&page[..], b"version HTTP/2.0 path /metrics");
        assert!(get(addr, "/metrics", t, 1024).await.is_err());
    }
}
