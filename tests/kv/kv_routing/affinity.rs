//! Adapter and session affinity end to end: real Envoy, kvepp, engines that publish KV events and
//! expose `vllm:lora_requests_info` on their `/metrics` as vLLM does.

use super::*;

/// Requests for model `chat`, which the InferenceModel sends to LoRA adapter `sql`.
fn chat(tokens: &[u32], hold: bool) -> String {
    serde_json::json!({"model": "chat", "prompt": tokens, "max_tokens": 8, "hold": hold})
        .to_string()
}

/// The pair's manifests with `chat` → adapter `sql`, and engine `b` ready or not.
fn manifests(a: &Engine, b: &Engine, b_ready: bool) -> String {
    let mut m = pool_yaml("pool") + &standard_models();
    m += &model_yaml("chat", "Standard", &[("sql", 1)]);
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, b_ready);
    m
}

async fn send(envoy: &Envoy, body: String, headers: &[(&str, &str)]) -> serde_json::Value {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let r = http(envoy.addr, "POST", "/v1/completions", &h, body).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

fn engine_of(v: &serde_json::Value) -> String {
    v["engine"].as_str().expect("engine").to_owned()
}

async fn adapter_picks(epp: &Epp, outcome: &str) -> f64 {
    epp.metric(&format!(
        "kvepp_adapter_picks_total{{outcome=\"{outcome}\"}}"
    ))
    .await
    .unwrap_or(0.0)
}

/// Sends fresh `chat` prompts until one goes to `want` with fit `outcome` (kvepp has scraped what
/// the engines report now), then checks that the next ones all do.
async fn chat_goes_to(envoy: &Envoy, epp: &Epp, want: &str, outcome: &str, seed: &mut u32) {
    wait_for(&format!("chat requests on {want} ({outcome})"), || {
        *seed += 1;
        let body = chat(&tokens(*seed, 2 * BLOCK), false);
        async move {
            let before = adapter_picks(epp, outcome).await;
            let got = engine_of(&send(envoy, body, &[]).await);
            (got == want && adapter_picks(epp, outcome).await > before).then_some(())
        }
    })
    .await;
    for _ in 0..6 {
        *seed += 1;
        let v = send(envoy, chat(&tokens(*seed, 2 * BLOCK), false), &[]).await;
        assert_eq!(engine_of(&v), want, "{outcome}");
    }
}

/// Requests for an adapter go to the engine running it while loads are comparable (the other would
/// have to evict), and to an engine with a free slot when that one saturates; never to an eviction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_follow_what_the_engines_run() {
    let (a, b, _, events_port) = engine_pair().await;
    a.set_metrics(0, "x,y", 2);
    b.set_metrics(0, "sql", 2);
    let epp = Epp::start(&manifests(&a, &b, true), |c| {
        c.kv_events.enabled = true;
        c.kv_events.port = events_port;
        c.block_size = Some(BLOCK as u32);
        c.engine_metrics.interval_ms = 20;
    })
    .await;
    until_engines_publish(&epp, &[&a, &b]).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let mut seed = 500;
    // b runs the adapter; a's slots are full.
    chat_goes_to(&envoy, &epp, "b", "loaded", &mut seed).await;
    // What kvepp keeps per endpoint, on /debug/endpoints.
    let eps = http(epp.metrics, "GET", "/debug/endpoints", &[], "")
        .await
        .json();
    let b_view = eps["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["addr"] == b.http.to_string())
        .unwrap()["lora_adapters"]
        .clone();
    assert_eq!(b_view["running"], serde_json::json!(["sql"]));
    assert_eq!(b_view["max_lora"], 2);
    assert!(b_view["scraped_ms_ago"].is_u64(), "{b_view}");
    assert_eq!(b_view["routed_recently"], serde_json::json!(["sql"]));
    // b saturates (a queue of 9 ≥ the threshold of 5) and a has a free slot: a, which then holds
    // the adapter (kvepp remembers what it sent there).
    a.set_metrics(0, "x", 2);
    b.set_metrics(9, "sql", 2);
    chat_goes_to(&envoy, &epp, "a", "free_slot", &mut seed).await;
    assert!(adapter_picks(&epp, "loaded").await >= 12.0);
    assert_eq!(adapter_picks(&epp, "evicts").await, 0.0, "never evicted");
    drop(envoy);
    epp.stop().await;
}

/// A prefix the engines cached for one adapter (their KV events name it) is found for requests
/// of that adapter and never for the base model: the adapter seeds the block hashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_cached_under_an_adapter_matches_only_that_adapter() {
    let (a, b, _, events_port) = engine_pair().await;
    // Their pages name the base model (`model_name`), so any other model is an adapter; both
    // have the same adapters, so only the cache tells them apart.
    a.set_metrics(0, "sql", 4);
    b.set_metrics(0, "sql", 4);
    let epp = Epp::start(&manifests(&a, &b, true), |c| {
        c.kv_events.enabled = true;
        c.kv_events.port = events_port;
        c.block_size = Some(BLOCK as u32);
        c.emit_endpoint_scores = true;
        c.engine_metrics.interval_ms = 20;
    })
    .await;
    until_engines_publish(&epp, &[&a, &b]).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let p = tokens(610, 8 * BLOCK);
    let home = engine_of(&send(&envoy, chat(&p, false), &[]).await);
    let home_addr = if home == "a" { a.http } else { b.http }.to_string();
    let other_addr = if home == "a" { b.http } else { a.http }.to_string();
    let score = |v: &serde_json::Value, addr: &str| v["scores"][addr].as_f64().expect("score");
    // Its engine's event applied first: a probe sent while both scored alike could be routed to
    // the other engine, which would then cache the prefix too and never score lower.
    wait_for("the adapter's blocks applied", || async {
        (epp.metric("kvepp_kv_event_blocks_stored_total").await? > 0.0).then_some(())
    })
    .await;
    // The adapter's prefix is found on its engine (once the index publishes the event).
    wait_for("the adapter's prefix found on its engine", || {
        let (p, home_addr, other_addr) = (p.clone(), home_addr.clone(), other_addr.clone());
        let envoy = &envoy;
        async move {
            let v = send(envoy, chat(&p, false), &[]).await;
            (score(&v, &home_addr) > score(&v, &other_addr)).then_some(())
        }
    })
    .await;
    // The same tokens for the base model match nowhere: equal scores.
    let base = prompt(&p, false);
    let v = send(&envoy, base, &[]).await;
    assert_eq!(
        score(&v, &home_addr),
        score(&v, &other_addr),
        "a base-model request matched the adapter's cache: {v}"
    );
    drop(envoy);
    epp.stop().await;
}

fn other(name: &str) -> &'static str {
    if name == "a" {
        "b"
    } else {
        "a"
    }
}

/// Session turns stick to their endpoint while it is busier than the other, move when it leaves
/// the pool, and stick to the new one when the old one is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_turns_stick_move_when_their_endpoint_leaves_and_stick_again() {
    let (a, b, _, events_port) = engine_pair().await;
    let epp = Epp::start(&manifests(&a, &b, true), |c| {
        c.kv_events.enabled = true;
        c.kv_events.port = events_port;
        c.block_size = Some(BLOCK as u32);
    })
    .await;
    until_engines_publish(&epp, &[&a, &b]).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let session = [("x-session-id", "conversation-42")];
    let first = engine_of(&send(&envoy, prompt(&tokens(700, BLOCK), false), &session).await);
    // Two held turns make its endpoint the busier one; they stay there.
    let mut held = Vec::new();
    for k in 0..2 {
        let mut s = TcpStreamRequest::start_with(
            envoy.addr,
            prompt(&tokens(710 + k, BLOCK), true),
            &session,
        )
        .await;
        assert!(s
            .first_chunk()
            .await
            .contains(&format!("\"engine\":\"{first}\"")));
        held.push(s);
    }
    assert_eq!(
        served_by(&envoy, &tokens(720, BLOCK)).await,
        other(&first),
        "without the session: the idle engine"
    );
    for k in 0..4 {
        let v = send(&envoy, prompt(&tokens(730 + k, BLOCK), false), &session).await;
        assert_eq!(
            engine_of(&v),
            first,
            "turn {k} sticks to the busier endpoint"
        );
    }
    // Its endpoint leaves the pool: the session moves.
    let (gone, stays) = if first == "a" { (&a, &b) } else { (&b, &a) };
    let without = if first == "a" {
        let mut m = pool_yaml("pool") + &standard_models();
        m += &model_yaml("chat", "Standard", &[("sql", 1)]);
        m += &slice_yaml("a", a.http, false);
        m += &slice_yaml("b", b.http, true);
        m
    } else {
        manifests(&a, &b, false)
    };
    epp.write_manifest("pool.yaml", &without);
    let moved = "kvepp_session_affinity_total{outcome=\"moved\"}";
    let moved_to = other(&first);
    wait_for("the session moved off the departed endpoint", || {
        let envoy = &envoy;
        let epp = &epp;
        async move {
            let v = send(envoy, prompt(&tokens(740, BLOCK), false), &session).await;
            (engine_of(&v) == moved_to && epp.metric(moved).await? >= 1.0).then_some(())
        }
    })
    .await;
    // It comes back (idle, its held streams ended): the session stays on its new endpoint.
    gone.state.release.notify_waiters();
    for s in held {
        assert_eq!(s.rest().await, "done\n");
    }
    epp.write_manifest("pool.yaml", &manifests(&a, &b, true));
    wait_for("the endpoint back in the pool", || async {
        (http(epp.metrics, "GET", "/debug/endpoints", &[], "")
            .await
            .json()["endpoints"]
            .as_array()?
            .len()
            == 2)
            .then_some(())
    })
    .await;
    let _ = stays;
    for k in 0..6 {
        let v = send(&envoy, prompt(&tokens(750 + k, BLOCK), false), &session).await;
        assert_eq!(engine_of(&v), other(&first), "turn {k} after the move");
    }
    let hits = epp
        .metric("kvepp_session_affinity_total{outcome=\"hit\"}")
        .await
        .unwrap_or(0.0);
    assert!(hits >= 12.0, "hits counted: {hits}");
    // An oversized session id is ignored (counted), the request routed all the same.
    let long = "s".repeat(300);
    send(
        &envoy,
        prompt(&tokens(760, BLOCK), false),
        &[("x-session-id", &long)],
    )
    .await;
    assert_eq!(
        epp.metric("kvepp_session_ids_ignored_total{reason=\"too_long\"}")
            .await,
        Some(1.0)
    );
    drop(envoy);
    epp.stop().await;
}

/// Sends prompts through `envoy` until `other` has applied replica events (its subscription is
/// live).
async fn until_applied(envoy: &Envoy, other: &Epp) {
    let mut k = 0;
    wait_for("replica events applied on the other replica", || {
        k += 1;
        async move {
            served_by(envoy, &tokens(950 + k, BLOCK)).await;
            (super::doors_and_replicas::applied(other).await > 0.0).then_some(())
        }
    })
    .await;
}

/// Two active-active replicas (`kvepp serve` with replica sync and no HTTP door) share session
/// bindings: a session started through one continues on the same endpoint through the other, even
/// where the other endpoint is idle; a replica started later recovers the bindings with the index
/// dump.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_session_bindings_and_a_new_replica_recovers_them() {
    let (a, b, one, two) =
        super::doors_and_replicas::two_replicas_with(kvepp::config::PickerKind::KvAware, false)
            .await;
    until_engines_publish(&one, &[&a, &b]).await;
    until_engines_publish(&two, &[&a, &b]).await;
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    let envoy2 = Envoy::start(bootstrap(), two.grpc).await;
    until_applied(&envoy1, &two).await;
    until_applied(&envoy2, &one).await;
    let session = [("x-session-id", "shared-session")];
    // Started through replica one, held there: its endpoint is the busier one everywhere.
    let mut held =
        TcpStreamRequest::start_with(envoy1.addr, prompt(&tokens(800, BLOCK), true), &session)
            .await;
    let first = held.first_chunk().await;
    let home = if first.contains("\"engine\":\"a\"") {
        "a"
    } else {
        "b"
    };
    let hits = "kvepp_session_affinity_total{outcome=\"hit\"}";
    let mut k = 0;
    wait_for("replica two follows replica one's binding", || {
        k += 1;
        let envoy2 = &envoy2;
        let two = &two;
        async move {
            let v = send(envoy2, prompt(&tokens(810 + k, BLOCK), false), &session).await;
            (engine_of(&v) == home && two.metric(hits).await? >= 1.0).then_some(())
        }
    })
    .await;
    assert_eq!(
        served_by(&envoy2, &tokens(830, BLOCK)).await,
        other(home),
        "without the session, replica two picks the idle engine"
    );
    for k in 0..5 {
        let v = send(&envoy2, prompt(&tokens(840 + k, BLOCK), false), &session).await;
        assert_eq!(engine_of(&v), home, "turn {k} through replica two");
    }
    // A third replica recovers the bindings from replica one's dump.
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    let peer = format!("http://{}", one.metrics);
    let three = Epp::start(&m, |c| {
        c.block_size = Some(BLOCK as u32);
        c.replica_sync.indexer_peers = vec![peer];
    })
    .await;
    let envoy3 = Envoy::start(bootstrap(), three.grpc).await;
    for k in 0..5 {
        let v = send(&envoy3, prompt(&tokens(850 + k, BLOCK), false), &session).await;
        assert_eq!(
            engine_of(&v),
            home,
            "turn {k} through the recovered replica"
        );
    }
    assert_eq!(three.metric(hits).await, Some(5.0));
    let engine = if home == "a" { &a } else { &b };
    engine.state.release.notify_waiters();
    assert_eq!(held.rest().await, "done\n");
    drop((envoy1, envoy2, envoy3));
    one.stop().await;
    two.stop().await;
    three.stop().await;
}
