//! What kvepp learns from the model servers themselves: the load signals they publish on their
//! Prometheus `/metrics` ([`metrics`]), their `/metadata` documents ([`metadata`]), and a small HTTP
//! GET client shared by both.

pub mod metadata;
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

/// `GET http://addr/path` on a fresh connection, body at most `limit` bytes, all within `timeout`.
pub async fn get(
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
        let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(http)?;
        tokio::spawn(conn);
        let req = hyper::Request::get(path)
            .header("host", addr.to_string())
            .body(Empty::<Bytes>::new())
            .map_err(|e| FetchError::Http(e.to_string(), path.to_owned()))?;
        let resp = sender.send_request(req).await.map_err(http)?;
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
