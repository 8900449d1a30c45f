//! The load driver's HTTP/1.1 client: one connection per request, as many concurrent as arrive.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use kvepp_test_support::client::request;
use tokio::time::Instant;

/// What happened to one streamed completion.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub status: u16,
    /// Error text when the request failed (transport or non-200).
    pub error: Option<String>,
    /// The engine that answered (`x-sim-engine`).
    pub engine: Option<String>,
    pub ttft: Option<Duration>,
    pub e2e: Option<Duration>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// Sends one streamed completion and times it: TTFT at the first body chunk, e2e at the end; the
/// usage comes from the last SSE event that has one.
pub async fn completion(addr: SocketAddr, body: Bytes, session: Option<&str>) -> Outcome {
    let start = Instant::now();
    let mut out = Outcome::default();
    let mut headers = vec![("content-type", "application/json")];
    if let Some(s) = session {
        headers.push(("x-session-id", s));
    }
    let resp = match request(addr, "POST", "/v1/completions", &headers, body).await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(e);
            return out;
        }
    };
    out.status = resp.status().as_u16();
    out.engine = resp
        .headers()
        .get(crate::fleet::ENGINE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut body = resp.into_body();
    let mut pending = String::new();
    let mut text = String::new();
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                out.error = Some(format!("body: {e}"));
                return out;
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if out.ttft.is_none() {
            out.ttft = Some(start.elapsed());
        }
        if out.status != 200 {
            text.push_str(&String::from_utf8_lossy(&data));
            continue;
        }
        pending.push_str(&String::from_utf8_lossy(&data));
        while let Some(end) = pending.find("\n\n") {
            let event: String = pending.drain(..end + 2).collect();
            if let Some(json) = event.trim().strip_prefix("data: ") {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(json) {
                    if let Some(u) = v.get("usage") {
                        let n = |k: &str| u.pointer(k).and_then(|x| x.as_u64()).unwrap_or(0);
                        out.prompt_tokens = n("/prompt_tokens");
                        out.completion_tokens = n("/completion_tokens");
                        out.cached_tokens = n("/prompt_tokens_details/cached_tokens");
                    }
                }
            }
        }
    }
    out.e2e = Some(start.elapsed());
    if out.status != 200 {
        out.error = Some(format!("HTTP {}: {}", out.status, text.trim()));
    } else if out.completion_tokens == 0 {
        out.error = Some("stream ended without usage".into());
    }
    out
}
