//! A simulated engine's HTTP surface (OpenAI completions and chat, `/metadata`, `/metrics`,
//! `/health`, `/debug/cache`).

use parking_lot::RwLock;
use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use tokio::sync::mpsc;

use super::engine::{Command, EngineCore, Job, Output, Usage};
// The header naming the prefill engine of a disaggregated pick, as kvepp sets it.
use kvepp_core::disagg::Domains;
use kvepp_core::disagg::PREFILLER_HEADER;
use kvepp_tokenizer::ModelTokenizer;

/// Response header naming the engine that served a request.
pub const ENGINE_HEADER: &str = "x-sim-engine";

/// Every engine's topology domains by address (filled as the fleet starts).
pub type Peers = Arc<RwLock<HashMap<SocketAddr, Domains>>>;

#[derive(Debug, Clone)]
pub struct EngineApp {
    pub name: Arc<str>,
    pub commands: mpsc::UnboundedSender<Command>,
    pub core: Arc<EngineCore>,
    pub tokenizer: Option<Arc<ModelTokenizer>>,
    pub metadata: Arc<String>,
    /// This engine's own address and topology.
    pub addr: SocketAddr,
    pub domains: Domains,
    pub peers: Peers,
}

pub fn router(app: EngineApp) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route(
            "/metadata",
            get(|State(a): State<EngineApp>| async move {
                (
                    [(header::CONTENT_TYPE, "application/json")],
                    (*a.metadata).clone(),
                )
            }),
        )
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .route("/debug/cache", get(debug_cache))
        .route("/debug/restart", post(restart))
        .with_state(app)
}

fn error(status: StatusCode, kind: &str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

#[derive(Clone, Copy, PartialEq)]
enum Api {
    Completions,
    Chat,
}

async fn completions(State(a): State<EngineApp>, headers: HeaderMap, body: Bytes) -> Response {
    serve(a, &headers, body, Api::Completions).await
}

async fn chat(State(a): State<EngineApp>, headers: HeaderMap, body: Bytes) -> Response {
    serve(a, &headers, body, Api::Chat).await
}

/// The prefill hop of a disaggregated request, as the llm-d routing sidecar runs it: the prompt
/// goes to the prefill engine (one output token), then its KV cache crosses the network to this
/// engine in the time the topology between the two takes. The prefill engine and the prompt
/// tokens it found cached, when the KV cache arrived; None (this engine prefills itself) when the
/// header is absent, names this engine, or the prefill engine failed.
async fn remote_prefill(
    a: &EngineApp,
    headers: &HeaderMap,
    model: &str,
    tokens: &[u32],
) -> Option<(SocketAddr, u64)> {
    let prefiller = headers
        .get(PREFILLER_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<SocketAddr>().ok())?;
    if prefiller == a.addr {
        return None;
    }
    let body = json!({"model": model, "prompt": tokens, "max_tokens": 1}).to_string();
    let json = [("content-type", "application/json")];
    let answer = match kvepp_test_support::client::request(
        prefiller,
        "POST",
        "/v1/completions",
        &json,
        body.into(),
    )
    .await
    {
        // Wait for the whole answer: the prefill is done when it ends.
        Ok(r) if r.status().is_success() => http_body_util::BodyExt::collect(r.into_body())
            .await
            .ok()
            .map(|b| b.to_bytes()),
        Ok(r) => {
            tracing::warn!(engine = &*a.name, prefiller = %prefiller, status = %r.status(), "prefill engine failed; prefilling locally");
            None
        }
        Err(e) => {
            tracing::warn!(engine = &*a.name, prefiller = %prefiller, error = %e, "prefill engine unreachable; prefilling locally");
            None
        }
    };
    let cached = serde_json::from_slice::<serde_json::Value>(&answer?)
        .ok()
        .and_then(|v| {
            v.pointer("/usage/prompt_tokens_details/cached_tokens")?
                .as_u64()
        })
        .unwrap_or(0);
    let theirs = a.peers.read().get(&prefiller).cloned().unwrap_or_default();
    let ms = a
        .core
        .params
        .transfer_ms(&a.domains, &theirs, tokens.len() as u64);
    tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
    Some((prefiller, cached))
}

/// Response header naming the prefill engine whose KV cache a decode engine used.
pub const PREFILLED_BY_HEADER: &str = "x-sim-prefilled-by";

fn with_prefilled_by(mut r: Response, by: Option<SocketAddr>) -> Response {
    if let Some(v) = by.and_then(|a| HeaderValue::from_str(&a.to_string()).ok()) {
        r.headers_mut()
            .insert(header::HeaderName::from_static(PREFILLED_BY_HEADER), v);
    }
    r
}

/// The prompt's token ids: ids as given, else the tokenizer's, else one token per byte.
fn prompt_tokens(
    a: &EngineApp,
    v: &serde_json::Value,
    api: Api,
) -> Result<Vec<u32>, (StatusCode, String)> {
    let bad = |m: String| (StatusCode::BAD_REQUEST, m);
    let field = if api == Api::Chat {
        "messages"
    } else {
        "prompt"
    };
    let Some(p) = v.get(field) else {
        return Err(bad(format!("`{field}` is required")));
    };
    if let Some(ids) = p.as_array().filter(|a| a.iter().all(|t| t.is_u64())) {
        if api == Api::Completions {
            return ids
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| bad("token ids must fit in 32 bits".into()));
        }
    }
    let raw = serde_json::value::to_raw_value(p).map_err(|e| bad(e.to_string()))?;
    match (&a.tokenizer, api) {
        (Some(t), Api::Chat) => t.chat_ids(&raw).map_err(|e| bad(e.to_string())),
        (Some(t), Api::Completions) => t.completion_ids(raw.get()).map_err(|e| bad(e.to_string())),
        (None, _) => Ok(match p.as_str() {
            Some(s) => s.bytes().map(u32::from).collect(),
            None => raw.get().bytes().map(u32::from).collect(),
        }),
    }
}

async fn serve(a: EngineApp, headers: &HeaderMap, body: Bytes, api: Api) -> Response {
    let v: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                "the body must be a JSON object".into(),
            )
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "BadRequestError",
                format!("invalid JSON: {e}"),
            )
        }
    };
    let model = v.get("model").and_then(|m| m.as_str()).unwrap_or("");
    // With adapter slots, any other model is a LoRA adapter (loaded on demand).
    let adapter = (model != a.core.params.model && a.core.params.max_loras > 0)
        .then(|| std::sync::Arc::<str>::from(model));
    if model != a.core.params.model && adapter.is_none() {
        return error(
            StatusCode::NOT_FOUND,
            "NotFoundError",
            format!("The model `{model}` does not exist."),
        );
    }
    let tokens = match prompt_tokens(&a, &v, api) {
        Ok(t) => t,
        Err((status, m)) => return error(status, "BadRequestError", m),
    };
    let max_tokens = v
        .get("max_completion_tokens")
        .or_else(|| v.get("max_tokens"))
        .and_then(|m| m.as_u64())
        .map_or(a.core.params.default_max_tokens, |m| {
            m.clamp(1, u64::from(u32::MAX)) as u32
        });
    // vLLM refuses what cannot fit in the KV cache (its maximum context length).
    let p = &a.core.params;
    let limit = p.total_kv_blocks * u64::from(p.block_size);
    let wanted = tokens.len() as u64 + u64::from(max_tokens);
    if wanted > limit {
        return error(
            StatusCode::BAD_REQUEST,
            "BadRequestError",
            format!(
                "This model's maximum context length is {limit} tokens. However, you requested \
                 {wanted} tokens ({} in the messages, {max_tokens} in the completion).",
                tokens.len()
            ),
        );
    }
    let stream = v.get("stream").and_then(|s| s.as_bool()) == Some(true);
    let include_usage = v
        .pointer("/stream_options/include_usage")
        .and_then(|s| s.as_bool())
        == Some(true);
    let remote = remote_prefill(&a, headers, model, &tokens).await;
    let prefilled_by = remote.map(|(by, _)| by);
    let (tx, rx) = mpsc::unbounded_channel();
    let backlog = tokens.len() as u64;
    let job = Job {
        tokens,
        max_tokens,
        out: tx,
        remote_cached_tokens: remote.map(|(_, cached)| cached),
        adapter,
    };
    a.core.counters.add_backlog(backlog);
    if a.commands.send(Command::Job(job)).is_err() {
        a.core.counters.take_backlog(backlog);
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "the engine is shutting down".into(),
        );
    }
    let reply = Reply {
        id: format!(
            "{}-{}",
            if api == Api::Chat { "chatcmpl" } else { "cmpl" },
            fastrand::u64(..)
        ),
        api,
        model: model.to_owned(),
        engine: a.name.clone(),
    };
    let engine = HeaderValue::from_str(&a.name).unwrap_or(HeaderValue::from_static("sim"));
    if stream {
        return with_prefilled_by(streamed(rx, reply, include_usage, engine), prefilled_by);
    }
    whole(rx, reply, engine, prefilled_by).await
}

/// A streamed answer: one event per generated chunk, the usage chunk when asked for, `[DONE]`.
fn streamed(
    rx: mpsc::UnboundedReceiver<Output>,
    reply: Reply,
    include_usage: bool,
    engine: HeaderValue,
) -> Response {
    let body = Body::from_stream(futures::stream::unfold(
        (rx, reply, include_usage, false),
        |(mut rx, reply, usage, done)| async move {
            if done {
                return None;
            }
            let (text, done) = match rx.recv().await {
                Some(Output::Tokens(n)) => (reply.chunk(n), false),
                Some(Output::Finished(u)) => {
                    let mut s = String::new();
                    if usage {
                        s += &reply.usage_chunk(&u);
                    }
                    s += "data: [DONE]\n\n";
                    (s, true)
                }
                // The engine dropped the request: end the stream.
                None => return None,
            };
            Some((
                Ok::<_, Infallible>(Bytes::from(text)),
                (rx, reply, usage, done),
            ))
        },
    ));
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::HeaderName::from_static(ENGINE_HEADER), engine),
        ],
        body,
    )
        .into_response()
}

/// A whole answer, once the engine finished the request.
async fn whole(
    rx: mpsc::UnboundedReceiver<Output>,
    reply: Reply,
    engine: HeaderValue,
    prefilled_by: Option<SocketAddr>,
) -> Response {
    let mut rx = rx;
    let mut n = 0u32;
    while let Some(o) = rx.recv().await {
        match o {
            Output::Tokens(k) => n += k,
            Output::Finished(u) => {
                let r = (
                    [
                        (
                            header::CONTENT_TYPE,
                            HeaderValue::from_static("application/json"),
                        ),
                        (header::HeaderName::from_static(ENGINE_HEADER), engine),
                    ],
                    reply.full(n, &u),
                )
                    .into_response();
                return with_prefilled_by(r, prefilled_by);
            }
        }
    }
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailableError",
        "the engine dropped the request".into(),
    )
}

struct Reply {
    id: String,
    api: Api,
    model: String,
    engine: Arc<str>,
}

fn text_of(n: u32) -> String {
    " tok".repeat(n as usize)
}

fn usage_json(u: &Usage) -> serde_json::Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens}})
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Completions, _) => "text_completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Chat, false) => "chat.completion",
        }
    }

    fn base(&self, chunk: bool) -> serde_json::Value {
        json!({"id": self.id, "object": self.object(chunk), "model": self.model,
               "system_fingerprint": format!("kvepp-sim/{}", self.engine)})
    }

    fn chunk(&self, n: u32) -> String {
        let mut v = self.base(true);
        v["choices"] = match self.api {
            Api::Completions => json!([{"index": 0, "text": text_of(n), "finish_reason": null}]),
            Api::Chat => {
                json!([{"index": 0, "delta": {"content": text_of(n)}, "finish_reason": null}])
            }
        };
        format!("data: {v}\n\n")
    }

    fn usage_chunk(&self, u: &Usage) -> String {
        let mut v = self.base(true);
        v["choices"] = json!([]);
        v["usage"] = usage_json(u);
        format!("data: {v}\n\n")
    }

    fn full(&self, n: u32, u: &Usage) -> String {
        let mut v = self.base(false);
        v["choices"] = match self.api {
            Api::Completions => {
                json!([{"index": 0, "text": text_of(n), "finish_reason": "length"}])
            }
            Api::Chat => {
                json!([{"index": 0, "message": {"role": "assistant", "content": text_of(n)}, "finish_reason": "length"}])
            }
        };
        v["usage"] = usage_json(u);
        v.to_string()
    }
}

async fn metrics(State(a): State<EngineApp>) -> impl IntoResponse {
    let c = &a.core.counters;
    let p = &a.core.params;
    let get = |x: &std::sync::atomic::AtomicU64| x.load(Ordering::Relaxed);
    // KV blocks held by running requests, from the pool itself.
    let usage = a.core.cache().in_use() as f64 / p.total_kv_blocks.max(1) as f64;
    let m = &p.model;
    let text = format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"{m}\"}} {running}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {waiting}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {usage}\n\
         # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{bs}\",num_gpu_blocks=\"{blocks}\",enable_prefix_caching=\"True\"}} 1.0\n\
         # TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {queries}\n\
         # TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {hits}\n\
         # TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{{model_name=\"{m}\"}} {queries}\n\
         # TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{{model_name=\"{m}\"}} {gen}\n\
         # TYPE vllm:request_success counter\nvllm:request_success_total{{model_name=\"{m}\"}} {done}\n\
         # TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{{model_name=\"{m}\"}} {preempted}\n",
        running = get(&c.running),
        waiting = get(&c.waiting),
        bs = p.block_size,
        blocks = p.total_kv_blocks,
        queries = get(&c.prompt_tokens),
        hits = get(&c.cached_tokens),
        gen = get(&c.generation_tokens),
        done = get(&c.finished),
        preempted = get(&c.preemptions),
    );
    let text = if p.max_loras > 0 {
        let (running, waiting) = a.core.adapters.lock().clone();
        let join = |v: &[std::sync::Arc<str>]| v.iter().map(|n| &**n).collect::<Vec<_>>().join(",");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        // vLLM's exposition: the adapters as labels, the sample's value a timestamp.
        format!(
            "{text}# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {now}\n",
            p.max_loras,
            join(&running),
            join(&waiting)
        )
    } else {
        text
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text)
}

async fn debug_cache(State(a): State<EngineApp>) -> impl IntoResponse {
    let blocks: Vec<u64> = a.core.cache().blocks().iter().map(|h| h.0).collect();
    (
        [(header::CONTENT_TYPE, "application/json")],
        json!({"engine": &*a.name, "blocks": blocks}).to_string(),
    )
}

/// `POST /debug/restart`: the engine restarts (what `kubectl delete pod` does to a vLLM pod that
/// comes back on the same address, minus the minutes of loading weights).
async fn restart(State(a): State<EngineApp>) -> Response {
    if a.commands.send(Command::Restart).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailableError",
            "the engine is shutting down".into(),
        );
    }
    (
        [(header::CONTENT_TYPE, "application/json")],
        json!({"engine": &*a.name, "restarted": true}).to_string(),
    )
        .into_response()
}
