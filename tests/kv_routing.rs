//! End to end KV-aware routing: real Envoy, kvepp, and two simulated engines that serve HTTP on
//! their own loopback addresses and publish vLLM KV events (msgpack over a ZMQ PUB socket) for
//! every prompt they take. Prompts are token ids, so no tokenizer is involved.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::routing::post;
use common::*;
use http_body_util::BodyExt;
use kvepp::request::tokenize::ModelTokenizer;
use kvepp_test_support::fnv64;
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
}

struct Engine {
    http: SocketAddr,
    state: Arc<EngineState>,
}

/// One `BlockStored` for the prompt's full blocks, with engine hashes of the engine's own (as
/// vLLM's), in the legacy tagged-array encoding.
fn stored_batch(name: &str, block: usize, tokens: &[u32]) -> Vec<u8> {
    let n = tokens.len() / block;
    let hashes = engine_hashes(name, block, tokens);
    let event = (
        "BlockStored",
        hashes,
        None::<u64>,
        tokens[..n * block].to_vec(),
        block as u32,
        None::<u32>,
        None::<String>,
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

async fn completions(State(st): State<Arc<EngineState>>, body: Bytes) -> axum::response::Response {
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json body");
    let tokens: Vec<u32> = match v.get("messages") {
        Some(m) => {
            let raw = serde_json::value::RawValue::from_string(m.to_string()).expect("raw");
            st.tokenizer.chat_ids(&raw).expect("chat template")
        }
        None => serde_json::from_value(v["prompt"].clone()).expect("token ids"),
    };
    st.events
        .send(stored_batch(&st.name, st.block, &tokens))
        .expect("publisher alive");
    let first = format!("{{\"engine\":\"{}\"}}\n", st.name);
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
        Self::serve(name, [127, 0, 0, 1].into(), BLOCK, metadata, tx).await
    }

    async fn start_with(name: &str, ip: IpAddr, events_port: u16, block: usize) -> Engine {
        let mut publisher = PubSocket::new();
        publisher
            .bind(&format!("tcp://{ip}:{events_port}"))
            .await
            .expect("bind PUB");
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        tokio::spawn(async move {
            let seq = AtomicU64::new(0);
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                let payload = tokio::select! {
                    p = rx.recv() => match p { Some(p) => p, None => return },
                    _ = tick.tick() => rmp_serde::to_vec(&(1.0f64, Vec::<()>::new())).expect("msgpack"),
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
        Self::serve(name, ip, block, metadata, tx).await
    }

    async fn serve(
        name: &str,
        ip: IpAddr,
        block: usize,
        metadata: serde_json::Value,
        events: mpsc::UnboundedSender<Vec<u8>>,
    ) -> Engine {
        let state = Arc::new(EngineState {
            name: name.into(),
            block,
            metadata,
            tokenizer: ModelTokenizer::load(&fixture_tokenizer()).expect("fixture tokenizer"),
            events,
            release: Notify::new(),
        });
        let app = axum::Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(completions))
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

/// Engines a (127.0.0.2) and b (127.0.0.3) publishing on the same port number (kvepp subscribes
/// to tcp://<endpoint ip>:<kv_events.port>, as with vLLM pods), and kvepp subscribed to both.
async fn two_engines(tweak: impl FnOnce(&mut kvepp::config::Config)) -> (Engine, Engine, Epp) {
    let events_port = free_port();
    let a = Engine::start("a", [127, 0, 0, 2].into(), events_port).await;
    let b = Engine::start("b", [127, 0, 0, 3].into(), events_port).await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    let epp = Epp::start(&m, |c| {
        c.kv_events.enabled = true;
        c.kv_events.port = events_port;
        c.block_size = Some(BLOCK as u32);
        tweak(c);
    })
    .await;
    until_engines_publish(&epp, &[&a, &b]).await;
    (a, b, epp)
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_holder_wins_cold_goes_to_least_loaded_and_streams_stay_booked() {
    let (a, b, epp) = two_engines(|_| {}).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let engines = [("a", &a), ("b", &b)];
    let other = |n: &str| if n == "a" { "b" } else { "a" };

    // A first prompt of 4 blocks goes somewhere; its engine publishes the blocks.
    let shared = tokens(1, 4 * BLOCK);
    let holder = served_by(&envoy, &shared).await;
    wait_for("the prefix in kvepp's index", || async {
        (epp.metric("kvepp_kv_event_blocks_stored_total").await? >= 4.0).then_some(())
    })
    .await;

    // Longer prompts sharing the prefix all go to the engine holding it.
    for k in 0..4u32 {
        let mut t = shared.clone();
        t.extend(tokens(10 + k, 2 * BLOCK));
        assert_eq!(
            served_by(&envoy, &t).await,
            holder,
            "prompt {k} sharing the prefix"
        );
    }

    // A long-running stream on the holder keeps its load booked while it runs...
    let mut held = shared.clone();
    held.extend(tokens(20, BLOCK));
    let mut stream = TcpStreamRequest::start(envoy.addr, prompt(&held, true)).await;
    let first = stream.first_chunk().await;
    assert!(
        first.contains(&format!("\"engine\":\"{holder}\"")),
        "{first}"
    );
    assert_eq!(epp.metric("kvepp_in_flight_requests").await, Some(1.0));
    // ...so cold prompts (no cached prefix anywhere) go to the other, less loaded engine.
    for k in 0..3 {
        assert_eq!(
            served_by(&envoy, &tokens(30 + k, 4 * BLOCK)).await,
            other(&holder),
            "cold prompt {k} while the holder streams"
        );
    }
    // The stream ends: its booking is released.
    let holder_engine = engines
        .iter()
        .find(|(n, _)| *n == holder)
        .expect("holder")
        .1;
    holder_engine.state.release.notify_one();
    let rest = stream.rest().await;
    assert_eq!(rest, "done\n");
    wait_for("booking released", || async {
        (epp.metric("kvepp_in_flight_requests").await? == 0.0).then_some(())
    })
    .await;
    let mode = epp
        .metric("kvepp_kv_prefix_mode_total{mode=\"token_ids\"}")
        .await
        .expect("mode metric");
    assert_eq!(mode, 9.0, "every pick counted in token-id mode");
    drop(envoy);
    epp.stop().await;
}

fn fixture_tokenizer() -> std::path::PathBuf {
    repo_root().join("tests/fixtures/tokenizer")
}

async fn chat_served_by(envoy: &Envoy, messages: &serde_json::Value) -> String {
    let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
    let r = http(
        envoy.addr,
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["engine"].as_str().expect("engine").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_tokenized_with_the_model_template() {
    // kvepp has the model's tokenizer and chat template; the engines tokenize the same way, so
    // a conversation's later turns find the blocks its first turn left on one engine.
    let (_a, _b, epp) = two_engines(|c| {
        c.engine_metrics.enabled = false;
        c.tokenizers.insert("m".into(), fixture_tokenizer());
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let system = "You are a helpful assistant. Answer briefly and precisely. ".repeat(8);
    let mut conversation = serde_json::json!([
        {"role": "system", "content": system},
        {"role": "user", "content": "What is KV cache aware routing?"}
    ]);
    let holder = chat_served_by(&envoy, &conversation).await;
    wait_for("the conversation in kvepp's index", || async {
        (epp.metric("kvepp_kv_event_blocks_stored_total").await? >= 4.0).then_some(())
    })
    .await;
    for turn in 0..3 {
        let turns = conversation.as_array_mut().expect("array");
        turns.push(serde_json::json!({"role": "assistant", "content": "It sends a request to the pod holding its prefix."}));
        turns.push(
            serde_json::json!({"role": "user", "content": format!("Follow-up question {turn}?")}),
        );
        assert_eq!(
            chat_served_by(&envoy, &conversation).await,
            holder,
            "turn {turn}"
        );
    }
    let tokens_mode = epp
        .metric("kvepp_kv_prefix_mode_total{mode=\"tokens\"}")
        .await
        .expect("mode metric");
    assert_eq!(tokens_mode, 4.0);
    drop(envoy);
    epp.stop().await;
}

/// An EndpointSlice whose endpoint serves `/metadata` on the same port (named `metadata`).
fn slice_with_metadata(slice: &str, addr: SocketAddr) -> String {
    format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {slice}, labels: {{kubernetes.io/service-name: pool}}}}\naddressType: IPv4\nendpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\nports: [{{name: http, port: {port}}}, {{name: metadata, port: {port}}}]\n",
        ip = addr.ip(),
        port = addr.port()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metadata_names_the_publishers_and_the_block_size() {
    // KV events are off in the configuration and the block size unset: both come from each
    // engine's /metadata (publishers on different ports of 127.0.0.1, blocks of 32 tokens).
    let block = 32;
    let a = Engine::start_with("a", [127, 0, 0, 1].into(), free_port(), block).await;
    let b = Engine::start_with("b", [127, 0, 0, 1].into(), free_port(), block).await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_with_metadata("a", a.http);
    m += &slice_with_metadata("b", b.http);
    let epp = Epp::start(&m, |c| {
        c.engine_metrics.enabled = false;
    })
    .await;
    wait_for("block size from metadata", || async {
        (epp.metric("kvepp_kv_block_size").await? == block as f64).then_some(())
    })
    .await;
    until_engines_publish(&epp, &[&a, &b]).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let shared = tokens(2, 3 * block);
    let holder = served_by(&envoy, &shared).await;
    wait_for("the prefix in kvepp's index", || async {
        (epp.metric("kvepp_kv_event_blocks_stored_total").await? >= 3.0).then_some(())
    })
    .await;
    for k in 0..4u32 {
        let mut t = shared.clone();
        t.extend(tokens(40 + k, block));
        assert_eq!(
            served_by(&envoy, &t).await,
            holder,
            "prompt {k} sharing the prefix"
        );
    }
    drop(envoy);
    epp.stop().await;
}

/// A request whose response body is read in two steps.
struct TcpStreamRequest {
    body: hyper::body::Incoming,
}

impl TcpStreamRequest {
    async fn start(addr: SocketAddr, body: String) -> Self {
        let headers = [("host", "test"), ("content-type", "application/json")];
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

/// A vLLM engine whose publisher binds after kvepp is running, publishes one batch and goes quiet:
/// kvepp catches it up from the replay socket, and the prefix routes there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_that_binds_late_and_goes_quiet_is_routed_to() {
    let (port, replay) = (free_port(), free_port());
    let events = format!("tcp://127.0.0.1:{port}");
    let a = Engine::start("a", [127, 0, 0, 1].into(), free_port()).await;
    let b = Engine::start_silent("b", &events, &format!("tcp://127.0.0.1:{replay}")).await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_with_metadata("a", a.http);
    m += &slice_with_metadata("b", b.http);
    let epp = Epp::start(&m, |c| {
        c.engine_metrics.enabled = false;
        c.block_size = Some(BLOCK as u32);
    })
    .await;
    until_engines_publish(&epp, &[&a]).await;
    // kvepp is subscribed to a and retrying b's publisher, which is not there yet.
    let mut p = publisher::Publisher::start(port, replay, "vllm").await;
    let shared = tokens(7, 4 * BLOCK);
    p.publish(0, &stored_batch("b", BLOCK, &shared)).await;
    wait_for("b's one batch in kvepp's index", || async {
        (epp.metric("kvepp_kv_event_blocks_stored_total").await? >= 4.0).then_some(())
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    for k in 0..4u32 {
        let mut t = shared.clone();
        t.extend(tokens(70 + k, BLOCK));
        assert_eq!(
            served_by(&envoy, &t).await,
            "b",
            "prompt {k} sharing b's prefix"
        );
    }
    p.quit().await;
    drop(envoy);
    epp.stop().await;
}

/// The EPP hashes kvepp's index holds for endpoint `addr` (rank 0).
async fn indexed(epp: &Epp, addr: SocketAddr) -> Vec<u64> {
    let r = http(epp.metrics, "GET", "/debug/kv-index", &[], "").await;
    let mut blocks: Vec<u64> = r.json()["endpoints"][addr.to_string()]["blocks"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
        .unwrap_or_default();
    blocks.sort_unstable();
    blocks
}

fn epp_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h: Vec<u64> = kvepp_core::hash::sequence_hashes(&kvepp_core::hash::local_block_hashes(
        tokens, BLOCK, None,
    ))
    .iter()
    .map(|s| s.0)
    .collect();
    h.sort_unstable();
    h
}

/// Faults on the KV-event path, through kvepp's own subscription: a gap larger than the
/// publisher's replay buffer (a removal lost for good) and a publisher restart. Each time kvepp's
/// index for the engine equals what the batches the publisher still holds build: stale entries go.
#[tokio::test]
async fn lost_batches_and_publisher_restarts_leave_no_stale_entries() {
    let (port, replay) = (free_port(), free_port());
    let events = format!("tcp://127.0.0.1:{port}");
    let b = Engine::start_silent("b", &events, &format!("tcp://127.0.0.1:{replay}")).await;
    let m = pool_yaml("pool") + &standard_models() + &slice_with_metadata("b", b.http);
    let epp = Epp::start(&m, |c| {
        c.engine_metrics.enabled = false;
        c.block_size = Some(BLOCK as u32);
    })
    .await;
    let mut p = publisher::Publisher::start(port, replay, "vllm").await;
    let (x, y, z) = (
        tokens(1, 4 * BLOCK),
        tokens(2, 3 * BLOCK),
        tokens(3, 2 * BLOCK),
    );
    p.publish(0, &stored_batch("b", BLOCK, &x)).await;
    wait_for("x indexed", || async {
        (indexed(&epp, b.http).await == epp_hashes(&x)).then_some(())
    })
    .await;

    // The engine evicts x and stores y, but kvepp misses both batches, and by the time it notices
    // the replay buffer holds only the second: x's removal is gone for good.
    let removed = removed_batch("b", BLOCK, &x);
    let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    p.cmd(&format!("skiphex 1 {}", hex(&removed))).await;
    p.cmd(&format!("skiphex 2 {}", hex(&stored_batch("b", BLOCK, &y))))
        .await;
    p.cmd("evict 2").await;
    p.publish(3, &rmp_serde::to_vec(&(1.0f64, Vec::<()>::new())).unwrap())
        .await;
    wait_for("the loss noticed", || async {
        (epp.metric("kvepp_kv_event_lost_batches_total").await? >= 1.0).then_some(())
    })
    .await;
    wait_for("only what the publisher holds", || async {
        (indexed(&epp, b.http).await == epp_hashes(&y)).then_some(())
    })
    .await;

    // The engine restarts (empty cache, numbering from 0) and stores z.
    p.quit().await;
    let mut p = publisher::Publisher::start(port, replay, "vllm").await;
    p.publish(0, &stored_batch("b", BLOCK, &z)).await;
    wait_for("the restart noticed", || async {
        (epp.metric("kvepp_kv_event_publisher_restarts_total")
            .await?
            >= 1.0)
            .then_some(())
    })
    .await;
    wait_for("only what the restarted engine stored", || async {
        (indexed(&epp, b.http).await == epp_hashes(&z)).then_some(())
    })
    .await;
    p.quit().await;
    epp.stop().await;
}

/// `kvepp serve` with both HTTP doors open: they share the picker's state. A reservation booked
/// over HTTP steers Envoy's picks away from its worker, and a request Envoy routed shows in the
/// slot tracker's `GET /loads`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_doors_share_state_with_envoy_picks() {
    let (a, b, epp) = two_engines(|c| {
        c.select_service_port = Some(0);
        c.slot_tracker_port = Some(0);
    })
    .await;
    let select = epp.select_service.expect("select door");
    let slots = epp.slot_tracker.expect("slot tracker door");
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let json_req = |addr: SocketAddr,
                    method: &'static str,
                    path: String,
                    body: serde_json::Value| async move {
        http(
            addr,
            method,
            &path,
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    };

    // Discovered endpoints are the workers, with stable ids.
    let workers = wait_for("both endpoints listed as workers", || async {
        let v = json_req(select, "GET", "/workers".into(), serde_json::Value::Null)
            .await
            .json();
        (v.as_array()?.len() == 2).then_some(v)
    })
    .await;
    let id_of = |e: &Engine| {
        let endpoint = format!("http://{}", e.http);
        workers
            .as_array()
            .expect("list")
            .iter()
            .find(|w| w["endpoint"] == serde_json::json!(endpoint))
            .and_then(|w| w["worker_id"].as_u64())
            .expect("worker listed")
    };
    let (wa, wb) = (id_of(&a), id_of(&b));
    let again = json_req(select, "GET", "/workers".into(), serde_json::Value::Null)
        .await
        .json();
    assert_eq!(again, workers, "ids are stable");

    // A heavy reservation on one engine sends cold prompts to the other, both ways.
    for (busy, free, name) in [(wa, "b", "a"), (wb, "a", "b")] {
        let hashes: Vec<u64> = (0..256).map(|i| u64::from(busy as u32) + i).collect();
        let r = json_req(
            select,
            "POST",
            "/reservations".into(),
            serde_json::json!({"reservation_id": format!("heavy-{name}"), "worker_id": busy,
                               "dp_rank": 0, "sequence_hashes": hashes, "isl_tokens": 4096}),
        )
        .await;
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        for k in 0..3 {
            assert_eq!(
                served_by(
                    &envoy,
                    &tokens(40 + k + u32::from(free == "a") * 10, 4 * BLOCK)
                )
                .await,
                free,
                "cold prompt {k} while {name} carries an HTTP reservation"
            );
        }
        let r = json_req(
            select,
            "DELETE",
            format!("/reservations/heavy-{name}"),
            serde_json::Value::Null,
        )
        .await;
        assert_eq!(r.status, 200);
    }

    // An Envoy pick shows in the slot tracker's loads while its stream runs.
    let held = tokens(60, 4 * BLOCK);
    let mut stream = TcpStreamRequest::start(envoy.addr, prompt(&held, true)).await;
    let first = stream.first_chunk().await;
    let (engine, worker) = if first.contains("\"engine\":\"a\"") {
        (&a, wa)
    } else {
        (&b, wb)
    };
    let loads = json_req(slots, "GET", "/loads".into(), serde_json::Value::Null)
        .await
        .json();
    let row = loads
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["worker_id"] == serde_json::json!(worker))
        .cloned()
        .expect("the picked worker's row");
    assert_eq!(row["active_decode_blocks"], serde_json::json!(4), "{loads}");
    engine.state.release.notify_one();
    assert_eq!(stream.rest().await, "done\n");
    wait_for("the Envoy pick released in /loads", || async {
        let v = json_req(slots, "GET", "/loads".into(), serde_json::Value::Null)
            .await
            .json();
        v.as_array()?
            .iter()
            .all(|r| r["active_decode_blocks"] == serde_json::json!(0))
            .then_some(())
    })
    .await;
    // Workers come from discovery: the doors do not register any.
    let r = json_req(
        select,
        "POST",
        "/workers".into(),
        serde_json::json!({"worker_id": 5}),
    )
    .await;
    assert_eq!(r.status, 409);
    drop(envoy);
    epp.stop().await;
}

/// Two kvepp replicas with replica sync on, each behind its own Envoy, over the same two engines.
async fn two_replicas(picker: kvepp::config::PickerKind) -> (Engine, Engine, Epp, Epp) {
    let events_port = free_port();
    let a = Engine::start("a", [127, 0, 0, 2].into(), events_port).await;
    let b = Engine::start("b", [127, 0, 0, 3].into(), events_port).await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    let (p1, p2) = (free_port(), free_port());
    let replica = |own: u16, peer: u16, picker| {
        move |c: &mut kvepp::config::Config| {
            c.kv_events.enabled = true;
            c.kv_events.port = events_port;
            c.block_size = Some(BLOCK as u32);
            c.picker = picker;
            c.slot_tracker_port = Some(0);
            c.replica_sync.bind = Some(format!("tcp://127.0.0.1:{own}"));
            c.replica_sync.advertise = Some(format!("tcp://127.0.0.1:{own}"));
            c.replica_sync.peers = vec![format!("tcp://127.0.0.1:{peer}")];
        }
    };
    let one = Epp::start(&m, replica(p1, p2, picker)).await;
    let two = Epp::start(&m, replica(p2, p1, picker)).await;
    (a, b, one, two)
}

async fn applied(epp: &Epp) -> f64 {
    epp.metric("kvepp_replica_sync_events_total{outcome=\"applied\"}")
        .await
        .unwrap_or(0.0)
}

/// Sends prompts through `envoy` until `other` has applied replica events (ZMQ subscriptions
/// take a moment; events before that are lost, as documented), then until it is quiet.
async fn until_replicas_synced(envoy: &Envoy, other: &Epp) {
    let mut k = 0;
    wait_for("replica events applied on the other replica", || {
        k += 1;
        async move {
            served_by(envoy, &tokens(900 + k, BLOCK)).await;
            (applied(other).await > 0.0).then_some(())
        }
    })
    .await;
    wait_for("the other replica's loads back to idle", || async {
        let v = http(other.slot_tracker?, "GET", "/loads", &[], "")
            .await
            .json();
        v.as_array()?
            .iter()
            .all(|r| r["active_decode_blocks"] == serde_json::json!(0))
            .then_some(())
    })
    .await;
}

/// Active-active: a stream held through replica one weighs on replica two's picks, so two replicas
/// balance like one (no leader election).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_picks_and_releases() {
    let (a, b, one, two) = two_replicas(kvepp::config::PickerKind::KvAware).await;
    until_engines_publish(&one, &[&a, &b]).await;
    until_engines_publish(&two, &[&a, &b]).await;
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    let envoy2 = Envoy::start(bootstrap(), two.grpc).await;
    until_replicas_synced(&envoy1, &two).await;

    let held = tokens(70, 4 * BLOCK);
    let mut stream = TcpStreamRequest::start(envoy1.addr, prompt(&held, true)).await;
    let first = stream.first_chunk().await;
    let (engine, name, other) = if first.contains("\"engine\":\"a\"") {
        (&a, "a", "b")
    } else {
        (&b, "b", "a")
    };
    let id = kvepp_core::kv::worker_id(&engine.http.to_string());
    let slots2 = two.slot_tracker.expect("door");
    wait_for("replica one's pick in replica two's loads", || async {
        let v = http(slots2, "GET", "/loads", &[], "").await.json();
        v.as_array()?
            .iter()
            .any(|r| {
                r["worker_id"] == serde_json::json!(id)
                    && r["active_decode_blocks"] == serde_json::json!(4)
            })
            .then_some(())
    })
    .await;
    for k in 0..3 {
        assert_eq!(
            served_by(&envoy2, &tokens(80 + k, 4 * BLOCK)).await,
            other,
            "cold prompt {k} through replica two while replica one streams on {name}"
        );
    }
    engine.state.release.notify_one();
    assert_eq!(stream.rest().await, "done\n");
    wait_for("the release reaches replica two", || async {
        let v = http(slots2, "GET", "/loads", &[], "").await.json();
        v.as_array()?
            .iter()
            .all(|r| r["active_decode_blocks"] == serde_json::json!(0))
            .then_some(())
    })
    .await;
    drop((envoy1, envoy2));
    one.stop().await;
    two.stop().await;
}

/// Approximate prefix routing: the prefix replica one routed is known to replica two, so the next
/// turn of the conversation keeps its affinity whichever replica takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_routed_prefixes_in_approximate_mode() {
    let (a, b, one, two) = two_replicas(kvepp::config::PickerKind::ApproximatePrefix).await;
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    let envoy2 = Envoy::start(bootstrap(), two.grpc).await;
    until_replicas_synced(&envoy1, &two).await;
    for turn in 0..3u32 {
        let first = tokens(100 + turn, 6 * BLOCK);
        let before = applied(&two).await;
        let holder = served_by(&envoy1, &first).await;
        // Routed prefix, admission, prefill completion and free: four events.
        wait_for(
            "replica one's routed prefix applied on replica two",
            || async { (applied(&two).await >= before + 4.0).then_some(()) },
        )
        .await;
        let mut next = first.clone();
        next.extend(tokens(200 + turn, 2 * BLOCK));
        assert_eq!(
            served_by(&envoy2, &next).await,
            holder,
            "turn {turn}: replica two keeps the conversation on the engine replica one chose"
        );
    }
    drop((a, b, envoy1, envoy2));
    one.stop().await;
    two.stop().await;
}

/// On Kubernetes the replicas' peers are the endpoints of kvepp's own Service: two replicas on
/// 127.0.0.4 and 127.0.0.5, one EndpointSlice listing both, no peer configured by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_find_each_other_through_their_own_service() {
    let events_port = free_port();
    let a = Engine::start("a", [127, 0, 0, 2].into(), events_port).await;
    let b = Engine::start("b", [127, 0, 0, 3].into(), events_port).await;
    let port = free_port();
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    m += &format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: kvepp-x, labels: {{kubernetes.io/service-name: kvepp}}}}\naddressType: IPv4\nendpoints:\n- addresses: [\"127.0.0.4\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: kvepp-1}}\n- addresses: [\"127.0.0.5\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: kvepp-2}}\nports: [{{name: replica-sync, port: {port}}}]\n"
    );
    let replica = |ip: &'static str| {
        move |c: &mut kvepp::config::Config| {
            c.kv_events.enabled = true;
            c.kv_events.port = events_port;
            c.block_size = Some(BLOCK as u32);
            c.slot_tracker_port = Some(0);
            c.replica_sync.bind = Some(format!("tcp://{ip}:{port}"));
            c.replica_sync.advertise = Some(format!("tcp://{ip}:{port}"));
            c.replica_sync.peers_service = Some("kvepp".into());
        }
    };
    let one = Epp::start(&m, replica("127.0.0.4")).await;
    let two = Epp::start(&m, replica("127.0.0.5")).await;
    for (epp, other) in [(&one, "127.0.0.5"), (&two, "127.0.0.4")] {
        let slots = epp.slot_tracker.expect("door");
        let want = serde_json::json!([format!("tcp://{other}:{port}")]);
        wait_for("the other replica as the only peer", || {
            let want = want.clone();
            async move { (http(slots, "GET", "/peers", &[], "").await.json() == want).then_some(()) }
        })
        .await;
    }
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    until_replicas_synced(&envoy1, &two).await;
    drop(envoy1);
    one.stop().await;
    two.stop().await;
}

/// A (re)started `kvepp serve` replica recovers the KV index from a peer's `/dump` before it serves:
/// with no KV events of its own, it holds what the peer learned from the engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_replica_recovers_the_index_from_a_peer() {
    let (a, b, one) = two_engines(|_| {}).await;
    let envoy = Envoy::start(bootstrap(), one.grpc).await;
    served_by(&envoy, &tokens(300, 4 * BLOCK)).await;
    served_by(&envoy, &tokens(301, 6 * BLOCK)).await;
    wait_for("both prompts in replica one's index", || async {
        (one.metric("kvepp_kv_event_blocks_stored_total").await? >= 10.0).then_some(())
    })
    .await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    let peer = format!("http://{}", one.metrics);
    let two = Epp::start(&m, |c| {
        c.block_size = Some(BLOCK as u32);
        c.replica_sync.indexer_peers = vec!["http://127.0.0.1:1".into(), peer];
    })
    .await;
    let index = |epp: &Epp| {
        let addr = epp.metrics;
        async move { http(addr, "GET", "/debug/kv-index", &[], "").await.json() }
    };
    let recovered = index(&two).await;
    assert_eq!(
        recovered,
        index(&one).await,
        "the same index, first unusable peer skipped"
    );
    let blocks: usize = recovered["endpoints"]
        .as_object()
        .unwrap()
        .values()
        .map(|e| e["blocks"].as_array().unwrap().len())
        .sum();
    assert_eq!(blocks, 10);
    drop(envoy);
    one.stop().await;
    two.stop().await;
}

async fn picks(epp: &Epp) -> f64 {
    epp.metric("kvepp_kv_prefix_mode_total{mode=\"token_ids\"}")
        .await
        .unwrap_or(0.0)
}

/// Two replicas behind one Envoy, which spreads ext_proc streams over both: each replica's loads
/// count every running request, its own and the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_behind_one_envoy_each_see_the_total_load() {
    let (a, b, one, two) = two_replicas(kvepp::config::PickerKind::KvAware).await;
    until_engines_publish(&one, &[&a, &b]).await;
    until_engines_publish(&two, &[&a, &b]).await;
    // Warm both directions with one Envoy per replica, then one Envoy over both.
    for (from, to) in [(&one, &two), (&two, &one)] {
        let e = Envoy::start(bootstrap(), from.grpc).await;
        until_replicas_synced(&e, to).await;
    }
    let mut both = bootstrap();
    for c in both["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("clusters")
        .iter_mut()
        .filter(|c| c["name"] == "kvepp")
    {
        let eps = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_sequence_mut()
            .expect("lb_endpoints");
        let mut second = eps[0].clone();
        let sa = &mut second["endpoint"]["address"]["socket_address"];
        sa["address"] = two.grpc.ip().to_string().into();
        sa["port_value"] = two.grpc.port().into();
        eps.push(second);
    }
    let envoy = Envoy::start(both, one.grpc).await;
    let (before1, before2) = (picks(&one).await, picks(&two).await);
    let mut streams = Vec::new();
    for k in 0..4 {
        let mut s =
            TcpStreamRequest::start(envoy.addr, prompt(&tokens(500 + k, 4 * BLOCK), true)).await;
        let first = s.first_chunk().await;
        let engine = if first.contains("\"engine\":\"a\"") {
            &a
        } else {
            &b
        };
        streams.push((s, engine));
    }
    assert!(
        picks(&one).await > before1 && picks(&two).await > before2,
        "Envoy used both replicas"
    );
    for epp in [&one, &two] {
        let slots = epp.slot_tracker.expect("door");
        wait_for("every running request in this replica's loads", || async {
            let v = http(slots, "GET", "/loads", &[], "").await.json();
            let total: u64 = v
                .as_array()?
                .iter()
                .map(|r| r["active_decode_blocks"].as_u64().unwrap_or(0))
                .sum();
            (total == 16).then_some(())
        })
        .await;
    }
    for (s, engine) in streams {
        engine.state.release.notify_one();
        assert_eq!(s.rest().await, "done\n");
    }
    for epp in [&one, &two] {
        let slots = epp.slot_tracker.expect("door");
        wait_for("all released on this replica", || async {
            let v = http(slots, "GET", "/loads", &[], "").await.json();
            v.as_array()?
                .iter()
                .all(|r| r["active_decode_blocks"] == serde_json::json!(0))
                .then_some(())
        })
        .await;
    }
    drop(envoy);
    one.stop().await;
    two.stop().await;
}
