//! End to end KV-aware routing: real Envoy, kvepp, and two simulated engines that serve HTTP on
//! their own loopback addresses and publish vLLM KV events (msgpack over a ZMQ PUB socket) for
//! every prompt they take. Prompts are token ids, so no tokenizer is involved.

mod affinity;
mod doors_and_replicas;
mod routing;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::routing::post;
use http_body_util::BodyExt;
use kvepp_test_support::fnv64;
use kvepp_test_support::prelude::*;
use kvepp_tokenizer::ModelTokenizer;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BLOCK: usize = 16;

struct EngineState {
    name: String,
    block: usize,
    /// What `/metadata` answers.
    metadata: serde_json::Value,
    /// Chat requests are tokenized with it (the fixture tokenizer, as the engine would).
    tokenizer: ModelTokenizer,
    events: mpsc::UnboundedSender<Vec<u8>>,
    release: Notify,
    /// What `/metrics` answers (empty: not a vLLM page, as before a test sets one).
    metrics: std::sync::Mutex<String>,
    /// Publish bytes that do not decode in place of each batch (an engine whose event encoding
    /// kvepp does not read).
    garble: Arc<std::sync::atomic::AtomicBool>,
}

impl Engine {
    /// Sets the engine's `/metrics` page: its queue and its LoRA adapters as vLLM exposes them.
    fn set_metrics(&self, waiting: u32, running_adapters: &str, max_lora: u32) {
        let page = format!(
            "vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 0.0\n\
             vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
             vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.1\n\
             vllm:lora_requests_info{{max_lora=\"{max_lora}\",running_lora_adapters=\"{running_adapters}\",waiting_lora_adapters=\"\"}} 1.7644e+09\n"
        );
        *self.state.metrics.lock().unwrap() = page;
    }
}

struct Engine {
    http: SocketAddr,
    state: Arc<EngineState>,
}

/// One `BlockStored` for the prompt's full blocks, with engine hashes of the engine's own (as
/// vLLM's), in the legacy tagged-array encoding.
fn stored_batch(name: &str, block: usize, tokens: &[u32]) -> Vec<u8> {
    stored_batch_of(name, block, tokens, None)
}

/// [`stored_batch`] of a request for LoRA adapter `lora` (vLLM names it in the event, and its own
/// hashes differ per adapter).
fn stored_batch_of(name: &str, block: usize, tokens: &[u32], lora: Option<&str>) -> Vec<u8> {
    let n = tokens.len() / block;
    let hashes = engine_hashes(&format!("{name}{}", lora.unwrap_or("")), block, tokens);
    let event = (
        "BlockStored",
        hashes,
        None::<u64>,
        tokens[..n * block].to_vec(),
        block as u32,
        lora.map(|_| 1u32),
        None::<String>,
        lora,
    );
    rmp_serde::to_vec(&(1.0f64, vec![event])).expect("msgpack")
}

/// The engine's own hashes of the prompt's full blocks.
fn engine_hashes(name: &str, block: usize, tokens: &[u32]) -> Vec<u64> {
    (1..=tokens.len() / block)
        .map(|i| {
            let bytes: Vec<u8> = tokens[..i * block]
                .iter()
                .flat_map(|t| t.to_le_bytes())
                .collect();
            fnv64(&[name.as_bytes(), &bytes].concat())
        })
        .collect()
}

/// One `BlockRemoved` of the prompt's full blocks.
fn removed_batch(name: &str, block: usize, tokens: &[u32]) -> Vec<u8> {
    let event = ("BlockRemoved", engine_hashes(name, block, tokens));
    rmp_serde::to_vec(&(1.0f64, vec![event])).expect("msgpack")
}

async fn completions(
    State(st): State<Arc<EngineState>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json body");
    let tokens: Vec<u32> = match v.get("messages") {
        Some(m) => {
            let raw = serde_json::value::RawValue::from_string(m.to_string()).expect("raw");
            st.tokenizer.chat_ids(&raw).expect("chat template")
        }
        None => serde_json::from_value(v["prompt"].clone()).expect("token ids"),
    };
    // Any model but the base one is a LoRA adapter, as vLLM serves them.
    let lora = v["model"].as_str().filter(|m| *m != "m");
    st.events
        .send(stored_batch_of(&st.name, st.block, &tokens, lora))
        .expect("publisher alive");
    let scores = headers
        .get("x-gateway-destination-endpoint-scores")
        .and_then(|s| s.to_str().ok())
        .unwrap_or("null");
    let first = format!("{{\"engine\":\"{}\",\"scores\":{scores}}}\n", st.name);
    if v["hold"].as_bool() != Some(true) {
        return axum::response::Response::new(Body::from(first));
    }
    // A long-running stream: first chunk now, the rest when the test releases it.
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(2);
    let st2 = st.clone();
    tokio::spawn(async move {
        let _ = tx.send(Ok(Bytes::from(first))).await;
        st2.release.notified().await;
        let _ = tx.send(Ok(Bytes::from_static(b"done\n"))).await;
    });
    axum::response::Response::new(Body::from_stream(
        tokio_stream::wrappers::ReceiverStream::new(rx),
    ))
}

impl Engine {
    /// HTTP on `ip`:ephemeral, KV events on `ip`:`events_port`; an empty batch every 20 ms keeps
    /// the subscription visible before any prompt arrives.
    async fn start(name: &str, ip: IpAddr, events_port: u16) -> Engine {
        Self::start_with(name, ip, events_port, BLOCK).await
    }

    /// An engine that publishes nothing itself: its `/metadata` names `events` and `replay` (a
    /// publisher run by the test).
    async fn start_silent(name: &str, events: &str, replay: &str) -> Engine {
        let metadata = serde_json::json!({
            "model": {"name": "m", "type": "Completions",
                      "runtime_config": {"block_size": BLOCK, "data_parallel_size": 1}},
            "kv_events": {"endpoints": {"0": events}, "replay_endpoints": {"0": replay}},
        });
        // What it would publish for the prompts it serves is discarded.
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        Self::serve(
            name,
            [127, 0, 0, 1].into(),
            BLOCK,
            metadata,
            tx,
            Arc::default(),
        )
        .await
    }

    async fn start_with(name: &str, ip: IpAddr, events_port: u16, block: usize) -> Engine {
        let mut publisher = PubSocket::new();
        publisher
            .bind(&format!("tcp://{ip}:{events_port}"))
            .await
            .expect("bind PUB");
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let garble = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let garbled = garble.clone();
        tokio::spawn(async move {
            let seq = AtomicU64::new(0);
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                let payload = tokio::select! {
                    p = rx.recv() => match p { Some(p) => p, None => return },
                    _ = tick.tick() => rmp_serde::to_vec(&(1.0f64, Vec::<()>::new())).expect("msgpack"),
                };
                // 0xc1 is never valid msgpack.
                let payload = if garbled.load(Ordering::Relaxed) {
                    vec![0xc1]
                } else {
                    payload
                };
                let mut m = ZmqMessage::from(Bytes::from_static(b"kv-events"));
                m.push_back(Bytes::copy_from_slice(
                    &seq.fetch_add(1, Ordering::Relaxed).to_be_bytes(),
                ));
                m.push_back(Bytes::from(payload));
                let _ = publisher.send(m).await;
            }
        });
        let metadata = serde_json::json!({
            "model": {"name": "m", "type": "Completions",
                      "runtime_config": {"block_size": block, "data_parallel_size": 1}},
            "kv_events": {"endpoints": {"0": format!("tcp://{ip}:{events_port}")}},
            "topology_domains": {"zone": "test-a"},
            "role": "both",
            "extra": "ignored"
        });
        Self::serve(name, ip, block, metadata, tx, garble).await
    }

    async fn serve(
        name: &str,
        ip: IpAddr,
        block: usize,
        metadata: serde_json::Value,
        events: mpsc::UnboundedSender<Vec<u8>>,
        garble: Arc<std::sync::atomic::AtomicBool>,
    ) -> Engine {
        let state = Arc::new(EngineState {
            name: name.into(),
            block,
            metadata,
            tokenizer: ModelTokenizer::load(&fixture_tokenizer()).expect("fixture tokenizer"),
            events,
            release: Notify::new(),
            metrics: std::sync::Mutex::new(String::new()),
            garble,
        });
        let app = axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(completions))
            .route(
                "/metrics",
                axum::routing::get(|State(st): State<Arc<EngineState>>| async move {
                    st.metrics.lock().unwrap().clone()
                }),
            )
            .route(
                "/metadata",
                axum::routing::get(|State(st): State<Arc<EngineState>>| async move {
                    st.metadata.to_string()
                }),
            )
            .with_state(state.clone());
        let listener = TcpListener::bind((ip, 0)).await.expect("bind engine");
        let http = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        Engine { http, state }
    }
}

/// Waits until kvepp has applied a batch from each engine (its subscriptions are live).
async fn until_engines_publish(epp: &Epp, engines: &[&Engine]) {
    for e in engines {
        let series = format!("kvepp_kv_event_batches_total{{endpoint=\"{}\"}}", e.http);
        wait_for("events from every engine", || {
            let s = series.clone();
            async move { (epp.metric(&s).await? > 0.0).then_some(()) }
        })
        .await;
    }
}

fn prompt(tokens: &[u32], hold: bool) -> String {
    serde_json::json!({"model": "m", "prompt": tokens, "max_tokens": 8, "hold": hold}).to_string()
}

async fn served_by(envoy: &Envoy, tokens: &[u32]) -> String {
    let r = http(
        envoy.addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        prompt(tokens, false),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["engine"].as_str().expect("engine").to_owned()
}

/// Engines a (127.0.0.2) and b (127.0.0.3) publishing KV events on one port number, and the
/// manifests of a pool holding both, and that port.
async fn engine_pair() -> (Engine, Engine, String, u16) {
    let events_port = free_port();
    let a = Engine::start("a", [127, 0, 0, 2].into(), events_port).await;
    let b = Engine::start("b", [127, 0, 0, 3].into(), events_port).await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    (a, b, m, events_port)
}

/// A slot tracker's `GET /loads` answer with no decode blocks left on any rank.
fn all_idle(loads: &serde_json::Value) -> Option<()> {
    loads
        .as_array()?
        .iter()
        .all(|r| r["active_decode_blocks"] == serde_json::json!(0))
        .then_some(())
}

/// kvepp subscribed to the KV events every engine publishes on `events_port`, at the tests'
/// block size.
fn subscribed(c: &mut kvepp::config::Config, events_port: u16) {
    c.kv_events.enabled = true;
    c.kv_events.port = events_port;
    c.block_size = Some(BLOCK as u32);
}

/// `epp`'s `/debug/kv-index`.
async fn kv_index(epp: &Epp) -> serde_json::Value {
    http(epp.metrics, "GET", "/debug/kv-index", &[], "")
        .await
        .json()
}

/// Engines a (127.0.0.2) and b (127.0.0.3) publishing on the same port number (kvepp subscribes
/// to tcp://<endpoint ip>:<kv_events.port>, as with vLLM pods), and kvepp subscribed to both.
async fn two_engines(tweak: impl FnOnce(&mut kvepp::config::Config)) -> (Engine, Engine, Epp) {
    let (a, b, m, events_port) = engine_pair().await;
    let epp = Epp::start(&m, |c| {
        subscribed(c, events_port);
        tweak(c);
    })
    .await;
    until_engines_publish(&epp, &[&a, &b]).await;
    (a, b, epp)
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

fn fixture_tokenizer() -> std::path::PathBuf {
    repo_root().join("tests/fixtures/tokenizer")
}

/// A request whose response body is read in two steps.
struct TcpStreamRequest {
    body: hyper::body::Incoming,
}

impl TcpStreamRequest {
    async fn start(addr: SocketAddr, body: String) -> Self {
        Self::start_with(addr, body, &[]).await
    }

    /// [`Self::start`] with `extra` request headers.
    async fn start_with(addr: SocketAddr, body: String, extra: &[(&str, &str)]) -> Self {
        let mut headers = vec![("host", "test"), ("content-type", "application/json")];
        headers.extend_from_slice(extra);
        let send = kvepp_test_support::client::request(
            addr,
            "POST",
            "/v1/completions",
            &headers,
            Bytes::from(body),
        );
        let resp = tokio::time::timeout(DEADLINE, send)
            .await
            .expect("headers in time")
            .expect("response");
        assert_eq!(resp.status(), 200);
        TcpStreamRequest {
            body: resp.into_body(),
        }
    }

    async fn first_chunk(&mut self) -> String {
        loop {
            let frame = tokio::time::timeout(DEADLINE, self.body.frame())
                .await
                .expect("first chunk in time")
                .expect("a frame")
                .expect("frame ok");
            if let Ok(data) = frame.into_data() {
                return String::from_utf8_lossy(&data).into_owned();
            }
        }
    }

    async fn rest(self) -> String {
        let body = tokio::time::timeout(DEADLINE, self.body.collect())
            .await
            .expect("end of stream in time")
            .expect("body")
            .to_bytes();
        String::from_utf8_lossy(&body).into_owned()
    }
}
