//! kvepp in front of real engines: two vLLM engines, the CPU build with the tiny random-weight model
//! (`scripts/install-vllm.sh`, `scripts/tiny_model.py`), each with a small KV cache (96 blocks of
//! 32 tokens, so a working set spread over both evicts), prefix caching, KV events over vLLM's own
//! ZMQ publisher, LoRA with one slot. Each engine is described by a real worker-agent sidecar
//! (`kvepp-agent`, manifests registry) and reached through a real Envoy. The engines' own counters
//! and their own event streams are the judge.
//!
//! The engines start once for the binary (two to four minutes on two cores) and are shared by the
//! cases, which run one at a time (each takes the fleet's lock); each case deploys its own kvepp,
//! agents and Envoy.
// Test code: a failed expectation is a failed test. The fleet's guard is held across awaits on
// purpose: it serialises cases that each run on their own runtime and thread, so no task of one
// runtime ever waits for it.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::await_holding_lock)]

mod sglang;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use kvepp::config::{Config, PickerKind};
use kvepp_core::hash::{local_block_hashes, SequenceHash};
use kvepp_test_support::prelude::*;
use kvepp_test_support::vllm::{EngineSpec, VllmEngine, VllmInstall};
use kvepp_test_support::TempDir;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// vLLM's smallest block size on the CPU attention backend.
const BLOCK: usize = 32;
/// How long an engine may take to start (two at once on two cores: up to ~4 minutes).
const ENGINE_START: Duration = Duration::from_secs(900);

struct Fleet {
    install: VllmInstall,
    engines: Vec<VllmEngine>,
    /// Engine logs (kept for the binary's life).
    _logs: TempDir,
}

static FLEET: OnceLock<Mutex<Fleet>> = OnceLock::new();

/// The shared engines, started on first use; holding the guard is holding the fleet.
fn fleet() -> MutexGuard<'static, Fleet> {
    let cell = FLEET.get_or_init(|| {
        let started = Instant::now();
        let install = VllmInstall::under(&repo_root()).unwrap_or_else(|e| panic!("{e}"));
        let logs = TempDir::new("vllm");
        let mut engines: Vec<VllmEngine> = (0..2)
            .map(|i| {
                let spec = EngineSpec {
                    name: format!("vllm-{i}"),
                    cpu: Some(i),
                    kv_cache_bytes: "12M".into(),
                    max_num_seqs: 4,
                    extra: Vec::new(),
                };
                VllmEngine::start(&install, spec, logs.path()).unwrap_or_else(|e| panic!("{e}"))
            })
            .collect();
        for e in &mut engines {
            e.wait_healthy(ENGINE_START)
                .unwrap_or_else(|err| panic!("{err}"));
        }
        eprintln!(
            "real_engines: two vLLM engines healthy in {:.0?}",
            started.elapsed()
        );
        Mutex::new(Fleet {
            install,
            engines,
            _logs: logs,
        })
    });
    cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The picker the KV-aware cases run: the default, or `KVEPP_TEST_PICKER` (e.g. `round-robin`,
/// to see the hit-ratio assertions fail when kvepp routes blindly).
fn picker_under_test(default: PickerKind) -> PickerKind {
    match std::env::var("KVEPP_TEST_PICKER").ok().as_deref() {
        None | Some("") => default,
        Some("round-robin") => PickerKind::RoundRobin,
        Some("least-loaded") => PickerKind::LeastLoaded,
        Some("approximate-prefix") => PickerKind::ApproximatePrefix,
        Some("kv-aware") => PickerKind::KvAware,
        Some(other) => panic!("KVEPP_TEST_PICKER={other}: not a picker"),
    }
}

// ---------------------------------------------------------------- a deployment per case

/// A worker-agent sidecar process beside one engine.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a worker-agent says of its engine.
#[derive(Debug, Clone)]
struct Target {
    name: String,
    http: SocketAddr,
    events_port: u16,
    replay_port: u16,
}

impl From<&VllmEngine> for Target {
    fn from(e: &VllmEngine) -> Self {
        Target {
            name: e.spec.name.clone(),
            http: e.http,
            events_port: e.events_port,
            replay_port: e.replay_port,
        }
    }
}

/// kvepp, one worker-agent per engine registering it in kvepp's manifests directory, and Envoy.
struct Deployment {
    epp: Epp,
    envoy: Envoy,
    _agents: Vec<Agent>,
}

/// The models the pool serves: the base model `m`, a Sheddable and a Critical alias of it, and
/// every adapter.
fn models(install: &VllmInstall) -> String {
    let mut m = pool_yaml("pool");
    m += &model_yaml("m", "Standard", &[]);
    m += &model_yaml("shed", "Sheddable", &[("m", 1)]);
    m += &model_yaml("crit", "Critical", &[("m", 1)]);
    for a in install.adapters() {
        m += &model_yaml(&a, "Standard", &[]);
    }
    m
}

/// [`deploy_targets`] of the fleet's engines.
async fn deploy(fleet: &Fleet, tweak: impl FnOnce(&mut Config)) -> Deployment {
    let targets: Vec<Target> = fleet.engines.iter().map(Target::from).collect();
    let d = deploy_targets(&fleet.install, &targets, tweak).await;
    // Until its first scrape of an engine kvepp hashes with the core's default block size: a
    // prompt routed then (approximate mode records it) is one no later prompt matches.
    // (A load-only picker hashes nothing: its index page is not JSON.)
    let metrics = d.epp.metrics;
    wait_for(
        "kvepp's block size learned from the engines",
        || async move {
            let page = http(metrics, "GET", "/debug/kv-index", &[], "").await;
            match serde_json::from_slice::<serde_json::Value>(&page.body) {
                Ok(v) => (v["block_size"].as_u64() == Some(BLOCK as u64)).then_some(()),
                Err(_) => Some(()),
            }
        },
    )
    .await;
    d
}

async fn deploy_targets(
    install: &VllmInstall,
    targets: &[Target],
    tweak: impl FnOnce(&mut Config),
) -> Deployment {
    let epp = Epp::start_unready(&models(install), |c| {
        c.kv_events.enabled = true;
        c.emit_endpoint_scores = true;
        tweak(c);
    })
    .await;
    let agents = targets
        .iter()
        .map(|t| start_agent(t, &epp.dir.path().to_path_buf()))
        .collect();
    epp.wait_ready().await;
    let addrs: Vec<String> = targets.iter().map(|t| t.http.to_string()).collect();
    let metrics = epp.metrics;
    wait_for("both engines in kvepp's pool", || {
        let addrs = addrs.clone();
        async move {
            let v = http(metrics, "GET", "/debug/endpoints", &[], "")
                .await
                .json();
            let listed: Vec<&str> = v["endpoints"]
                .as_array()?
                .iter()
                .filter_map(|e| e["addr"].as_str())
                .collect();
            addrs
                .iter()
                .all(|a| listed.contains(&a.as_str()))
                .then_some(())
        }
    })
    .await;
    let mut b = bootstrap();
    b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["route_config"]["virtual_hosts"][0]["response_headers_to_add"] =
        serde_yaml::from_str("[{header: {key: x-upstream-host, value: '%UPSTREAM_HOST%'}}, {header: {key: x-endpoint-scores, value: '%REQ(x-gateway-destination-endpoint-scores)%'}}]")
            .unwrap();
    let envoy = Envoy::start(b, epp.grpc).await;
    Deployment {
        epp,
        envoy,
        _agents: agents,
    }
}

/// `kvepp-agent` as deployed beside an engine, but registering in a manifests directory: its
/// `/metadata` names the model and the engine's KV-event and replay sockets (no block size: kvepp
/// learns it from the engine).
fn start_agent(engine: &Target, dir: &PathBuf) -> Agent {
    let log =
        std::fs::File::create(dir.join(format!(".agent-{}.log", engine.name))).expect("agent log");
    let child = Command::new(env!("CARGO_BIN_EXE_kvepp-agent"))
        .args(["--component", "pool", "--registry", "manifests"])
        .arg("--manifests-dir")
        .arg(dir)
        .args(["--listen", &format!("127.0.0.1:{}", free_port())])
        .args([
            "--engine-health-url",
            &format!("http://{}/health", engine.http),
        ])
        .args(["--engine-port", &engine.http.port().to_string()])
        .args(["--model-name", "m"])
        .args(["--kv-events-port", &engine.events_port.to_string()])
        .args(["--kv-events-replay-port", &engine.replay_port.to_string()])
        .args(["--pod-name", &engine.name, "--pod-ip", "127.0.0.1"])
        .args(["--check-interval-ms", "500"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("kvepp-agent");
    Agent(child)
}

// ---------------------------------------------------------------- requests

/// A response through Envoy: status, the engine that served it, the body.
struct Served {
    status: u16,
    engine: Option<SocketAddr>,
    /// kvepp's score of each candidate for this request (`emit_endpoint_scores`, echoed by Envoy).
    scores: String,
    body: serde_json::Value,
}

async fn send(envoy: &Envoy, path: &str, body: serde_json::Value) -> Served {
    let r = http(
        envoy.addr,
        "POST",
        path,
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await;
    Served {
        status: r.status,
        engine: r.header("x-upstream-host").and_then(|h| h.parse().ok()),
        scores: r.header("x-endpoint-scores").unwrap_or_default().to_owned(),
        body: serde_json::from_slice(&r.body).unwrap_or(serde_json::Value::Null),
    }
}

fn completion(model: &str, prompt: serde_json::Value, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": true, "temperature": 0})
}

/// Deterministic text of about `words` words (a seeded choice from a small vocabulary).
fn text(seed: u64, words: usize) -> String {
    const VOCAB: &[&str] = &[
        "the", "cache", "router", "engine", "prefix", "token", "block", "request", "model", "pod",
        "latency", "first", "second", "stream", "decode", "prefill", "queue", "batch", "memory",
        "envoy", "cluster", "policy", "score", "load", "adapter", "session", "topology", "zone",
        "metric", "event", "index", "hash", "of", "and", "to", "in", "with", "for", "on", "from",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
        if i % 11 == 0 {
            out.push_str(&format!(" {}", x % 1000));
        }
    }
    out
}

/// How many tokens the engine makes of a completion prompt (its own `/tokenize`).
async fn engine_token_count(engine: SocketAddr, prompt: &str) -> usize {
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    let r = http(
        engine,
        "POST",
        "/tokenize",
        &[("content-type", "application/json")],
        body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["count"].as_u64().expect("count") as usize
}

/// The engines' prefix-cache counters summed: (hits, queries), in tokens.
fn cache_counters(fleet: &Fleet) -> (f64, f64) {
    fleet.engines.iter().fold((0.0, 0.0), |(h, q), e| {
        (
            h + e
                .metric_sum("vllm:prefix_cache_hits_total")
                .expect("metrics"),
            q + e
                .metric_sum("vllm:prefix_cache_queries_total")
                .expect("metrics"),
        )
    })
}

// ---------------------------------------------------------------- the engine's own event stream

/// What an engine's KV events say it holds, in kvepp's sequence hashes (rebuilt from the events'
/// token ids), read from the engine's replay socket from its first batch: an independent
/// subscriber, sharing nothing with kvepp's.
#[derive(Debug, Default)]
struct EngineBlocks {
    held: HashSet<SequenceHash>,
    stored_events: usize,
    removed_blocks: usize,
}

/// Every batch the publisher at `port` still buffers, as (seq, payload).
async fn replay(port: u16) -> Vec<(u64, Vec<u8>)> {
    let mut s = DealerSocket::new();
    s.connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .expect("connect replay");
    let mut req = ZmqMessage::from(bytes::Bytes::new());
    req.push_back(bytes::Bytes::copy_from_slice(&0u64.to_be_bytes()));
    s.send(req).await.expect("replay request");
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(DEADLINE, s.recv())
            .await
            .expect("replay reply in time")
            .expect("replay frame");
        let frames: Vec<bytes::Bytes> = m.into_vec();
        let n = frames.len();
        assert!(n >= 2, "a replay message has a sequence and a payload");
        let seq = u64::from_be_bytes(frames[n - 2][..].try_into().expect("8-byte seq"));
        if seq == u64::MAX {
            return out;
        }
        out.push((seq, frames[n - 1].to_vec()));
    }
}

fn as_u64(v: &serde_json::Value) -> u64 {
    v.as_u64()
        .or_else(|| v.as_i64().map(|i| i as u64))
        .unwrap_or_else(|| panic!("not a 64-bit hash: {v}"))
}

async fn engine_blocks(engine: &VllmEngine) -> EngineBlocks {
    published_blocks(engine.replay_port).await
}

/// [`EngineBlocks`] of the publisher whose replay socket is `replay_port`.
async fn published_blocks(replay_port: u16) -> EngineBlocks {
    let mut known: HashMap<u64, SequenceHash> = HashMap::new();
    let mut held: HashSet<u64> = HashSet::new();
    let mut out = EngineBlocks::default();
    for (_, payload) in replay(replay_port).await {
        let batch: serde_json::Value = rmp_serde::from_slice(&payload).expect("msgpack batch");
        for ev in batch[1].as_array().expect("events") {
            match ev["type"].as_str().expect("tagged event") {
                "BlockStored" => {
                    out.stored_events += 1;
                    let bs = ev["block_size"].as_u64().expect("block_size") as usize;
                    let tokens: Vec<u32> = ev["token_ids"]
                        .as_array()
                        .expect("token_ids")
                        .iter()
                        .map(|t| t.as_u64().expect("id") as u32)
                        .collect();
                    let lora = ev["lora_name"].as_str();
                    let locals = local_block_hashes(&tokens, bs, lora);
                    let mut parent = ev["parent_block_hash"]
                        .as_u64()
                        .or_else(|| ev["parent_block_hash"].as_i64().map(|i| i as u64))
                        .map(|p| *known.get(&p).expect("parent stored before its child"));
                    for (h, local) in ev["block_hashes"]
                        .as_array()
                        .expect("block_hashes")
                        .iter()
                        .zip(locals)
                    {
                        let seq = SequenceHash::chain(parent, local);
                        known.insert(as_u64(h), seq);
                        held.insert(as_u64(h));
                        parent = Some(seq);
                    }
                }
                "BlockRemoved" => {
                    for h in ev["block_hashes"].as_array().expect("block_hashes") {
                        out.removed_blocks += usize::from(held.remove(&as_u64(h)));
                    }
                }
                "AllBlocksCleared" => held.clear(),
                other => panic!("unknown event {other}"),
            }
        }
    }
    out.held = held.iter().map(|h| known[h]).collect();
    out
}

/// What kvepp's index holds for the endpoint at `addr`.
async fn kvepp_blocks(epp: &Epp, addr: SocketAddr) -> (u64, HashSet<SequenceHash>) {
    let v = http(epp.metrics, "GET", "/debug/kv-index", &[], "")
        .await
        .json();
    let blocks = v["endpoints"][addr.to_string()]["blocks"]
        .as_array()
        .map(|a| a.iter().map(|h| SequenceHash(as_u64(h))).collect())
        .unwrap_or_default();
    (v["block_size"].as_u64().unwrap_or(0), blocks)
}

/// Waits until kvepp's index for every engine equals what the engine's events say it holds.
async fn until_index_matches_engines(fleet: &Fleet, epp: &Epp) -> Vec<EngineBlocks> {
    let mut truth = Vec::new();
    for e in &fleet.engines {
        let t = kvepp_test_support::wait_until(
            "kvepp's index equal to the engine's events",
            DEADLINE,
            || async {
                let t = engine_blocks(e).await;
                let (_, k) = kvepp_blocks(epp, e.http).await;
                (k == t.held).then_some(t)
            },
        )
        .await;
        let t = match t {
            Ok(t) => t,
            Err(why) => {
                let t = engine_blocks(e).await;
                let (_, k) = kvepp_blocks(epp, e.http).await;
                let events: Vec<String> = epp
                    .metrics_text()
                    .await
                    .lines()
                    .filter(|l| l.starts_with("kvepp_kv_event") && l.contains(&e.http.to_string()))
                    .map(str::to_owned)
                    .collect();
                panic!(
                    "{} ({}): {why}; engine holds {}, kvepp {}, only in the engine {}, only in kvepp {}; kvepp's counters:\n{}",
                    e.spec.name,
                    e.http,
                    t.held.len(),
                    k.len(),
                    t.held.difference(&k).count(),
                    k.difference(&t.held).count(),
                    events.join("\n")
                );
            }
        };
        truth.push(t);
    }
    truth
}

// ---------------------------------------------------------------- cases

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_block_size_is_learned_from_vllm_cache_config_info() {
    let fleet = fleet();
    let d = deploy(&fleet, |c| c.block_size = None).await;
    let epp = &d.epp;
    let learned = wait_for("a learned block size", || async {
        let (bs, _) = kvepp_blocks(epp, fleet.engines[0].http).await;
        (bs == BLOCK as u64).then_some(bs)
    })
    .await;
    assert_eq!(learned, 32, "vLLM's CPU engines run 32-token blocks");
    let page = fleet.engines[0].metrics().unwrap();
    assert!(
        page.contains("vllm:cache_config_info{") && page.contains("block_size=\"32\""),
        "the engine states its block size only on its metrics page"
    );
}

/// Distinct token-id prompts (ids well inside the vocabulary, no special tokens).
fn id_prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|i| 1000 + (seed * 7919 + i * 31) % 100_000)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvepp_index_equals_each_engines_events_through_evictions_and_a_restart() {
    let mut fleet = fleet();
    let salt = 17;
    {
        let d = deploy(&fleet, |_| {}).await;
        // 6 prompts of 24 blocks straight to each engine (144 blocks against its 96, so both
        // evict), then 6 more through Envoy: kvepp indexes what the engines report either way.
        for (n, e) in fleet.engines.iter().enumerate() {
            for i in 0..6 {
                let body = completion("m", id_prompt(salt * 100 + 10 * n as u32 + i, 24).into(), 2);
                let r = post_json(e.http, body.to_string()).await;
                assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            }
        }
        for i in 0..6 {
            let r = send(
                &d.envoy,
                "/v1/completions",
                completion("m", id_prompt(salt * 100 + 40 + i, 24).into(), 2),
            )
            .await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
        let truth = until_index_matches_engines(&fleet, &d.epp).await;
        for (e, t) in fleet.engines.iter().zip(&truth) {
            assert!(t.stored_events > 0, "{} stored blocks", e.spec.name);
            assert!(
                t.removed_blocks > 0,
                "{} evicted blocks (its cache is smaller than what it was sent)",
                e.spec.name
            );
        }
        eprintln!(
            "real_engines: after evictions, blocks held {:?}",
            truth.iter().map(|t| t.held.len()).collect::<Vec<_>>()
        );
    }
    // The first engine restarts in place (same ports, a new publisher, an empty cache).
    let t0 = Instant::now();
    fleet.engines[0].restart().expect("restart");
    fleet.engines[0]
        .wait_healthy(ENGINE_START)
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("real_engines: engine restarted in {:.0?}", t0.elapsed());
    let d = deploy(&fleet, |_| {}).await;
    let mut served = HashSet::new();
    for i in 0..6 {
        let r = send(
            &d.envoy,
            "/v1/completions",
            completion("m", id_prompt(salt * 100 + 60 + i, 8).into(), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        served.insert(r.engine.expect("x-upstream-host"));
    }
    assert!(
        served.contains(&fleet.engines[0].http),
        "the restarted engine takes requests again: {served:?}"
    );
    let truth = until_index_matches_engines(&fleet, &d.epp).await;
    assert!(
        truth[0].held.len() <= 6 * 8,
        "the restarted engine holds only what it was sent since: {}",
        truth[0].held.len()
    );
}

/// `groups` shared prefixes of `words` words, each sent `repeats` times with its own ending, the
/// groups taking turns (every group once a round, as users of a chat service do). An odd number of
/// groups makes round robin send each group's turns to both engines alternately, so each engine
/// sees every group: more than its cache holds, which least-recently-used eviction cannot keep
/// when the groups come back in turn.
fn shared_prefix_workload(
    salt: u64,
    groups: usize,
    repeats: usize,
    words: usize,
) -> Vec<(usize, String, String)> {
    (0..repeats)
        .flat_map(|r| (0..groups).map(move |g| (g, r)))
        .map(|(g, r)| {
            let prefix = format!("{}\n", text(salt * 1000 + g as u64, words));
            let ending = text(salt * 1000 + 500 + (g * repeats + r) as u64, 24);
            (g, prefix, ending)
        })
        .collect()
}

struct RunResult {
    ratio: f64,
    ideal: f64,
    /// Groups whose repeats all went to the engine their first request went to.
    groups_on_one_engine: usize,
    groups: usize,
    /// Each request's engine (its index in the fleet), in the order sent.
    placements: String,
    /// For each request that left its group's first engine: the group, and kvepp's scores.
    moves: Vec<(usize, String)>,
}

/// Runs the shared-prefix workload through a kvepp with `tweak`; the engines' own hit ratio over
/// the run, and the ideal (every repeat hits its group's full prefix blocks).
async fn shared_prefix_run(fleet: &Fleet, salt: u64, tweak: impl FnOnce(&mut Config)) -> RunResult {
    // 5 groups of ~24 blocks: 120 blocks against an engine's 96, while the 3 groups kvepp keeps
    // on one engine (72 blocks) fit.
    let (groups, repeats) = (5, 6);
    let d = deploy(fleet, tweak).await;
    let work = shared_prefix_workload(salt, groups, repeats, 520);
    let mut prefix_tokens = vec![0usize; groups];
    for (g, prefix, _) in &work {
        if prefix_tokens[*g] == 0 {
            prefix_tokens[*g] = engine_token_count(fleet.engines[0].http, prefix).await;
        }
    }
    let before = cache_counters(fleet);
    let mut first: Vec<Option<SocketAddr>> = vec![None; groups];
    let mut stayed = vec![true; groups];
    let (mut ideal_hits, mut seen) = (0usize, vec![false; groups]);
    let mut placements = String::new();
    let mut moves = Vec::new();
    for (g, prefix, ending) in &work {
        let r = send(
            &d.envoy,
            "/v1/completions",
            completion("m", format!("{prefix}{ending}").into(), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        let engine = r.engine.expect("x-upstream-host");
        let index = fleet.engines.iter().position(|e| e.http == engine);
        placements.push_str(&index.map_or("?".into(), |i| i.to_string()));
        if *g + 1 == groups {
            placements.push(' ');
        }
        match first[*g] {
            None => first[*g] = Some(engine),
            Some(e) if e != engine => {
                stayed[*g] = false;
                moves.push((*g, r.scores.clone()));
            }
            Some(_) => {}
        }
        // A repeat can hit every full block of the prefix but the one the ending may change.
        if seen[*g] {
            ideal_hits += prefix_tokens[*g].saturating_sub(1) / BLOCK * BLOCK;
        }
        seen[*g] = true;
    }
    let after = cache_counters(fleet);
    let (hits, queries) = (after.0 - before.0, after.1 - before.1);
    RunResult {
        ratio: hits / queries,
        ideal: ideal_hits as f64 / queries,
        groups_on_one_engine: stayed.iter().filter(|s| **s).count(),
        groups,
        placements,
        moves,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_prefix_groups_hit_the_engine_cache_in_tokens_and_approximate_modes() {
    let fleet = fleet();
    let model = fleet.install.model.clone();
    let tokens = shared_prefix_run(&fleet, 101, |c| {
        c.picker = picker_under_test(PickerKind::KvAware);
        c.tokenizers.insert("m".into(), model.clone());
    })
    .await;
    let approximate = shared_prefix_run(&fleet, 202, |c| {
        c.picker = picker_under_test(PickerKind::ApproximatePrefix);
        c.kv_events.enabled = false;
    })
    .await;
    let round_robin = shared_prefix_run(&fleet, 303, |c| {
        c.picker = PickerKind::RoundRobin;
        c.kv_events.enabled = false;
    })
    .await;
    for (name, r) in [
        ("tokens", &tokens),
        ("approximate", &approximate),
        ("round robin", &round_robin),
    ] {
        eprintln!(
            "real_engines: {name}: engine hit ratio {:.3} (ideal {:.3}, {:.0}% of it), {}/{} groups on one engine, engines by round: {}",
            r.ratio,
            r.ideal,
            100.0 * r.ratio / r.ideal,
            r.groups_on_one_engine,
            r.groups,
            r.placements.trim_end()
        );
        for (g, scores) in r.moves.iter().filter(|_| name != "round robin") {
            eprintln!("real_engines: {name}: group {g} moved; kvepp's scores: {scores}");
        }
    }
    for (name, r) in [("tokens", &tokens), ("approximate", &approximate)] {
        assert!(
            r.ratio >= 0.8 * r.ideal,
            "{name} mode: the engines' hit ratio {:.3} is below 80% of the ideal {:.3}",
            r.ratio,
            r.ideal
        );
        assert!(
            r.ratio >= 1.5 * round_robin.ratio,
            "{name} mode: hit ratio {:.3} is not 1.5x round robin's {:.3}",
            r.ratio,
            round_robin.ratio
        );
        assert_eq!(
            r.groups_on_one_engine, r.groups,
            "{name} mode: each group's repeats on its first engine"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_give_the_engine_the_token_ids_kvepp_hashed() {
    let fleet = fleet();
    let model = fleet.install.model.clone();
    let d = deploy(&fleet, |c| {
        c.tokenizers.insert("m".into(), model.clone());
    })
    .await;
    let messages = serde_json::json!([
        {"role": "system", "content": text(4242, 500)},
        {"role": "user", "content": text(4343, 40)},
    ]);
    let body = serde_json::json!({"model": "m", "messages": messages, "max_tokens": 2,
                                  "ignore_eos": true, "temperature": 0});
    let first = send(&d.envoy, "/v1/chat/completions", body.clone()).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let engine = first.engine.expect("x-upstream-host");
    let served_by = fleet
        .engines
        .iter()
        .find(|e| e.http == engine)
        .expect("one of the engines");
    // kvepp's own rendering and tokenization of the messages, hashed as kvepp hashes blocks.
    let tok = kvepp_tokenizer::ModelTokenizer::load(&model).expect("tokenizer");
    let raw = serde_json::value::RawValue::from_string(messages.to_string()).unwrap();
    let ids = tok.chat_ids(&raw).expect("chat template");
    let ours = kvepp_core::hash::sequence_hashes(&local_block_hashes(&ids, BLOCK, None));
    assert!(ours.len() >= 16, "a long prompt: {} blocks", ours.len());
    let usage = first.body["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage");
    assert_eq!(
        usage as usize,
        ids.len(),
        "the engine's prompt is as long as kvepp's rendering"
    );
    let theirs = engine_blocks(served_by).await;
    let missing = ours.iter().filter(|h| !theirs.held.contains(h)).count();
    assert_eq!(
        missing,
        0,
        "every full block kvepp hashed is a block the engine reports holding ({} of {} missing)",
        missing,
        ours.len()
    );
    let hits_before = served_by
        .metric_sum("vllm:prefix_cache_hits_total")
        .unwrap();
    let again = send(&d.envoy, "/v1/chat/completions", body).await;
    assert_eq!(again.status, 200);
    assert_eq!(
        again.engine,
        Some(engine),
        "the repeat goes where its blocks are"
    );
    let hits = served_by
        .metric_sum("vllm:prefix_cache_hits_total")
        .unwrap()
        - hits_before;
    assert!(
        hits >= ((ours.len() - 1) * BLOCK) as f64,
        "the repeat hits the engine's cache: {hits} tokens of {} blocks",
        ours.len()
    );
}

/// Streams a long completion straight to `engine` (hidden from kvepp) until the returned task is
/// aborted.
fn hold_request(engine: SocketAddr, model: &str, max_tokens: u32) -> tokio::task::JoinHandle<()> {
    let mut body = completion(model, text(max_tokens as u64, 30).into(), max_tokens);
    body["stream"] = true.into();
    tokio::spawn(async move {
        loop {
            let req = kvepp_test_support::client::request(
                engine,
                "POST",
                "/v1/completions",
                &[("host", "engine"), ("content-type", "application/json")],
                bytes::Bytes::from(body.to_string()),
            );
            if let Ok(resp) = req.await {
                let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            }
        }
    })
}

/// The adapters kvepp read from `addr`'s `vllm:lora_requests_info`.
async fn running_adapters(epp: &Epp, addr: SocketAddr) -> Vec<String> {
    let v = http(epp.metrics, "GET", "/debug/endpoints", &[], "")
        .await
        .json();
    v["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["addr"] == addr.to_string())
        .flat_map(|e| e["lora_adapters"]["running"].as_array().cloned())
        .flatten()
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_stay_on_the_engine_that_holds_the_adapter() {
    let fleet = fleet();
    let adapter = fleet.install.adapters()[0].clone();
    let second = fleet.install.adapters()[1].clone();
    // Engines that have served both adapters before (a first LoRA request on a CPU engine also
    // pays one-time setup, which would read to kvepp's TTFT model as a slow engine).
    for e in &fleet.engines {
        for name in [&adapter, &second] {
            let r = post_json(e.http, completion(name, text(7, 20).into(), 2).to_string()).await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        }
    }
    let d = deploy(&fleet, |c| {
        c.picker = picker_under_test(PickerKind::KvAware)
    })
    .await;
    let first = send(
        &d.envoy,
        "/v1/completions",
        completion(&adapter, text(1, 40).into(), 2),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let home = first.engine.expect("x-upstream-host");
    // The adapter running on its engine, as vLLM reports it (a request held on it), and the other
    // adapter running on the other engine's one slot: both engines carry the same kind of load,
    // and only the first holds the adapter the next requests name.
    let other = fleet
        .engines
        .iter()
        .map(|e| e.http)
        .find(|a| *a != home)
        .expect("two engines");
    // Each hold restarts when it ends; a request sent to the wrong engine waits at most one hold
    // (150 tokens) for its slot and then fails the check below, naming kvepp's scores.
    let holds = [
        hold_request(home, &adapter, 150),
        hold_request(other, &second, 150),
    ];
    let both_running = || async {
        for (engine, name) in [(home, &adapter), (other, &second)] {
            wait_for(
                "kvepp reads the adapter from vllm:lora_requests_info",
                || async {
                    running_adapters(&d.epp, engine)
                        .await
                        .contains(name)
                        .then_some(())
                },
            )
            .await;
        }
    };
    for i in 0..5 {
        // Each request is decided while kvepp sees both adapters running.
        both_running().await;
        let r = send(
            &d.envoy,
            "/v1/completions",
            completion(&adapter, text(100 + i, 40).into(), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        if r.engine != Some(home) {
            let seen = http(d.epp.metrics, "GET", "/debug/endpoints", &[], "").await;
            // How kvepp judged each engine's fit for the adapter, and the saturation it saw.
            let metrics = d.epp.metrics_text().await;
            let judged: Vec<&str> = metrics
                .lines()
                .filter(|l| !l.starts_with('#') && (l.contains("adapter") || l.contains("saturat")))
                .collect();
            panic!(
                "adapter request {i} went to {:?}, not to {home}, the engine holding {adapter}; kvepp's scores: {}; kvepp's endpoints: {}; kvepp's adapter and saturation series: {judged:?}",
                r.engine,
                r.scores,
                String::from_utf8_lossy(&seen.body)
            );
        }
    }
    for h in holds {
        h.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_get_429_while_both_engines_queue_and_critical_ones_are_served() {
    let fleet = fleet();
    let d = deploy(&fleet, |_| {}).await;
    // Hidden load straight to each engine: more than its 4 running slots plus kvepp's queue
    // threshold (5 waiting).
    let holds: Vec<_> = fleet
        .engines
        .iter()
        .flat_map(|e| (0..12).map(|_| hold_request(e.http, "m", 300)))
        .collect();
    // The engines' own queues first (their metrics pages), then kvepp's answer: a probe that an
    // engine takes instead is abandoned after 2 s (which aborts it there) and sent again.
    kvepp_test_support::wait_until("both engines queue", Duration::from_secs(120), || async {
        fleet
            .engines
            .iter()
            .all(|e| e.metric_sum("vllm:num_requests_waiting").unwrap_or(0.0) >= 6.0)
            .then_some(())
    })
    .await
    .expect("the hidden load queues on both engines");
    let shed = completion("shed", "a sheddable request".into(), 1).to_string();
    let refused = kvepp_test_support::wait_until(
        "a sheddable request refused",
        Duration::from_secs(60),
        || async {
            let r = tokio::time::timeout(
                Duration::from_secs(2),
                kvepp_test_support::client::request(
                    d.envoy.addr,
                    "POST",
                    "/v1/completions",
                    &[("host", "test"), ("content-type", "application/json")],
                    bytes::Bytes::from(shed.clone()),
                ),
            )
            .await;
            match r {
                Ok(Ok(resp)) if resp.status() == 429 => Some(resp),
                _ => None,
            }
        },
    )
    .await
    .expect("a 429 while both engines are saturated");
    assert_eq!(refused.status(), 429);
    for e in &fleet.engines {
        assert!(
            e.metric_sum("vllm:num_requests_waiting").unwrap() >= 1.0,
            "{} queues requests",
            e.spec.name
        );
    }
    let served = tokio::time::timeout(
        Duration::from_secs(300),
        kvepp_test_support::client::request(
            d.envoy.addr,
            "POST",
            "/v1/completions",
            &[("host", "test"), ("content-type", "application/json")],
            bytes::Bytes::from(completion("crit", "a critical request".into(), 1).to_string()),
        ),
    )
    .await
    .expect("the critical request in time")
    .expect("a response");
    assert_eq!(
        served.status(),
        200,
        "a critical request is served while the engines are saturated"
    );
    for h in holds {
        h.abort();
    }
}
