//! Envoy's picks: prefix holders, chat templates, publisher metadata, late and restarted
//! publishers.

use super::*;

/// A first prompt of 4 blocks sent through Envoy, and the engine that served it once kvepp's
/// index holds its blocks: (the prompt, that engine).
async fn four_blocks_held(envoy: &Envoy, epp: &Epp) -> (Vec<u32>, String) {
    let shared = tokens(1, 4 * BLOCK);
    let holder = served_by(envoy, &shared).await;
    wait_for("the prefix in kvepp's index", || async {
        (epp.metric("kvepp_kv_event_blocks_stored_total").await? >= 4.0).then_some(())
    })
    .await;
    (shared, holder)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_holder_wins_cold_goes_to_least_loaded_and_streams_stay_booked() {
    holder_wins_and_streams_stay_booked(false).await;
}

/// The same under Dynamo's cost without bounded loads, where picks take the ordered shortcut
/// (the pool's endpoints registered in the slot tracker, the snapshot's list named): every pick
/// is counted as ordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_dynamos_cost_the_same_picks_are_ordered() {
    holder_wins_and_streams_stay_booked(true).await;
}

async fn holder_wins_and_streams_stay_booked(dynamo: bool) {
    let (a, b, epp) = two_engines(|c| {
        if dynamo {
            c.router.cost_model = kvepp_core::cost::CostModel::Dynamo;
            c.router.load_bound = 0.0;
        }
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let engines = [("a", &a), ("b", &b)];
    let other = |n: &str| if n == "a" { "b" } else { "a" };

    // A first prompt of 4 blocks goes somewhere; its engine publishes the blocks.
    let (shared, holder) = four_blocks_held(&envoy, &epp).await;

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
    // The default cost (predicted TTFT) reads every candidate; Dynamo's takes the shortcut.
    let (ordered, scanned) = (
        epp.metric("kvepp_kv_picks_total{path=\"ordered\"}").await,
        epp.metric("kvepp_kv_picks_total{path=\"scan\"}").await,
    );
    let want = if dynamo { (9.0, 0.0) } else { (0.0, 9.0) };
    assert_eq!((ordered, scanned), (Some(want.0), Some(want.1)));
    drop(envoy);
    epp.stop().await;
}

/// A conversation's turns sent as token ids through Envoy: the first is read whole (its first
/// chunk remembered), the second reads all but that chunk (and has its chunks remembered), the
/// third reads only what follows the second's last whole chunk (counted by source); every turn
/// goes to the engine holding the earlier turns' blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_next_turn_of_token_ids_reads_only_what_it_adds() {
    let (_a, _b, epp) = two_engines(|_| {}).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let counts = || async {
        let ids = |source: &str| format!("kvepp_prompt_token_ids_total{{source=\"{source}\"}}");
        (
            epp.metric(&ids("cached")).await.unwrap_or(-1.0),
            epp.metric(&ids("read")).await.unwrap_or(-1.0),
        )
    };
    // ~21 KB of ids: chunks of at least 8 KiB (~1,170 ids each here), then the last ids.
    let mut turn = tokens(1, 3000);
    let holder = served_by(&envoy, &turn).await;
    wait_for("the first turn in kvepp's index", || async {
        let stored = epp.metric("kvepp_kv_event_blocks_stored_total").await?;
        (stored >= (3000 / BLOCK) as f64).then_some(())
    })
    .await;
    assert_eq!(counts().await, (0.0, 3000.0));
    let mut before = 0.0;
    for (k, (low, high)) in [(2, (1000.0, 1500.0)), (3, (2000.0, 3500.0))] {
        turn.extend(tokens(k, 500));
        assert_eq!(served_by(&envoy, &turn).await, holder, "turn {k}");
        let (cached, read) = counts().await;
        assert_eq!(cached + read, [0, 0, 6500, 10500][k as usize] as f64);
        assert!(
            (low..high).contains(&(cached - before)),
            "turn {k}: {} ids from the cache",
            cached - before
        );
        before = cached;
    }
    drop(envoy);
    epp.stop().await;
}

/// `router.load_bound` through Envoy: while a stream holds the engine that caches a prefix, a
/// prompt with less than half of its blocks cached there is passed over to the idle engine (the
/// cost alone would keep it), a prompt with most of it cached is exempt and stays, and the
/// passed-over pick is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_loads_pass_over_a_busy_holder_unless_the_prompt_is_mostly_cached_there() {
    busy_holder_under_bounded_loads(0.0).await;
}

/// `router.load_bound_cached` through Envoy: the same busy holder, but the exempt prompt has a
/// bound of its own (1 × the mean, one request per engine here), so the idle engine takes the
/// prefix over too, and that passed-over pick is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cached_bound_lets_an_idle_engine_take_a_busy_holders_prefix_over() {
    busy_holder_under_bounded_loads(1.0).await;
}

/// Bounded loads at 1.0 with `load_bound_cached` at `cached`: a stream holds the prefix holder,
/// then a prompt with 4 of its 6 blocks cached there (exempt) and one with 4 of 10 (not).
async fn busy_holder_under_bounded_loads(cached: f64) {
    // The mechanism under Dynamo's cost, with half the prompt cached as the exemption (the
    // defaults are the predicted-TTFT cost and a quarter).
    let (a, b, epp) = two_engines(|c| {
        c.router.cost_model = kvepp_core::cost::CostModel::Dynamo;
        c.router.load_bound = 1.0;
        c.router.load_bound_exempt_cached = 0.5;
        c.router.load_bound_cached = cached;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let other = |n: &str| if n == "a" { "b" } else { "a" };
    let (shared, holder) = four_blocks_held(&envoy, &epp).await;
    // One stream held on the holder: with one request in the pool the bound is one per engine.
    let mut held = shared.clone();
    held.extend(tokens(2, BLOCK));
    let mut stream = TcpStreamRequest::start(envoy.addr, prompt(&held, true)).await;
    let first = stream.first_chunk().await;
    assert!(
        first.contains(&format!("\"engine\":\"{holder}\"")),
        "{first}"
    );
    // 4 of 6 blocks cached on the holder: exempt, the holder keeps it unless the cached bound
    // (one request per engine) passes it over.
    let mut mostly = shared.clone();
    mostly.extend(tokens(4, 2 * BLOCK));
    let (expected, moved) = if cached > 0.0 {
        (other(&holder), 1.0)
    } else {
        (holder.as_str(), 0.0)
    };
    assert_eq!(
        served_by(&envoy, &mostly).await,
        expected,
        "cached bound {cached}"
    );
    assert_eq!(
        epp.metric("kvepp_kv_load_bounded_picks_total").await,
        Some(moved)
    );
    // 4 of 10 cached there: Dynamo's cost prefers the holder (6 blocks to prefill and 11
    // decoding against 10 and 10), the bound moves it. (With the cached bound the other engine
    // served `mostly` and holds its blocks by now or soon; either way the holder is over.)
    let mut partly = shared.clone();
    partly.extend(tokens(3, 6 * BLOCK));
    assert_eq!(served_by(&envoy, &partly).await, other(&holder));
    let bounded = epp
        .metric("kvepp_kv_load_bounded_picks_total")
        .await
        .unwrap_or(0.0);
    assert!(bounded >= moved, "{bounded}");
    let engine = if holder == "a" { &a } else { &b };
    engine.state.release.notify_one();
    assert_eq!(stream.rest().await, "done\n");
    drop(envoy);
    epp.stop().await;
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
    // The caches served the earlier turns: the first request's two messages were misses, each
    // later turn found the messages before its new one.
    let lookups = |cache: &str, result: &str| {
        let series = format!(
            "kvepp_tokenizer_cache_lookups_total{{model=\"m\",cache=\"{cache}\",result=\"{result}\"}}"
        );
        let epp = &epp;
        async move { epp.metric(&series).await.unwrap_or(0.0) }
    };
    let (hits, misses) = (
        lookups("messages", "hit").await,
        lookups("messages", "miss").await,
    );
    assert!(
        misses >= 2.0 && hits > misses,
        "messages: {hits} hits, {misses} misses"
    );
    assert!(lookups("segments", "hit").await > 0.0, "segments hit");
    // The tokenizer ran once per segment the cache did not hold, and its CPU time was counted.
    let calls = epp.metric("kvepp_tokenizer_calls_total{model=\"m\"}").await;
    assert_eq!(calls, Some(lookups("segments", "miss").await));
    let cpu = epp
        .metric("kvepp_tokenizer_cpu_seconds_total{model=\"m\"}")
        .await
        .expect("tokenizer CPU metric");
    assert!(cpu > 0.0, "tokenizer CPU {cpu} s");
    // Short prompts are hashed directly (the memo starts at 32 blocks), and counted.
    let hashed = epp
        .metric("kvepp_kv_prompt_hash_blocks_total{source=\"hashed\"}")
        .await
        .expect("prompt hash metric");
    assert!(hashed >= 4.0, "{hashed} blocks hashed");
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
    let mut blocks: Vec<u64> = kv_index(epp).await["endpoints"][addr.to_string()]["blocks"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
        .unwrap_or_default();
    blocks.sort_unstable();
    blocks
}

fn epp_hashes(tokens: &[u32]) -> Vec<u64> {
    hashes_at(tokens, BLOCK)
}

/// kvepp's hashes of `tokens`' full blocks of `block` tokens, sorted.
fn hashes_at(tokens: &[u32], block: usize) -> Vec<u64> {
    let mut h: Vec<u64> = kvepp_core::hash::sequence_hashes(&kvepp_core::hash::local_block_hashes(
        tokens, block, None,
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

/// A publisher that only stores (it never sends a removal) cannot grow kvepp's index past what
/// its engine reports it has room for: `num_gpu_blocks` (+ `num_cpu_blocks`) of
/// `vllm:cache_config_info`, plus the stated margin; the oldest blocks go, counted.
#[tokio::test]
async fn a_publisher_that_only_stores_stays_within_its_engines_capacity() {
    let (a, _b, epp) = two_engines(|_| {}).await;
    *a.state.metrics.lock().unwrap() = "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n\
         vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 0.0\n\
         vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.1\n\
         vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"30\",num_cpu_blocks=\"10\"} 1.0\n"
        .to_owned();
    // 60 prompts of 8 blocks: 480 blocks stored, none removed.
    for seed in 0..60 {
        let batch = stored_batch("a", BLOCK, &tokens(1000 + seed, 8 * BLOCK));
        a.state.events.send(batch).unwrap();
    }
    let bound = kvepp_core::kv::capacity_limit(40);
    assert_eq!(bound, 40 + 10 + 64, "the stated margin");
    let stored = "kvepp_kv_event_blocks_stored_total";
    wait_for("every block applied", || async {
        (epp.metric(stored).await? >= 480.0).then_some(())
    })
    .await;
    let evicted = wait_for("oldest blocks dropped", || async {
        let n = epp.metric("kvepp_kv_index_evicted_blocks_total").await?;
        let pairs = epp.metric("kvepp_kv_index_pairs").await?;
        (pairs <= bound as f64 && n >= (480 - bound) as f64).then_some(n)
    })
    .await;
    assert_eq!(evicted, (480 - bound) as f64);
    // Every batch's time from arrival to publication was observed.
    let lag = "kvepp_kv_event_apply_lag_seconds_count";
    assert!(epp.metric(lag).await.unwrap_or(0.0) >= 60.0, "{lag}");
}

/// An engine whose KV events stop decoding: kvepp counts them, drops what that engine's events
/// had said (never mixed with what follows), and matches it by what kvepp routes to it, so a
/// prompt's follow-ups still go where it went; once its events decode again its blocks come from
/// them anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_events_do_not_decode_is_matched_by_what_was_routed_to_it() {
    let (a, b, epp) = two_engines(|_| {}).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let (_, holder) = four_blocks_held(&envoy, &epp).await;
    let (h, other) = if holder == "a" { (&a, &b) } else { (&b, &a) };
    assert!(!indexed(&epp, h.http).await.is_empty());

    h.state.garble.store(true, Ordering::Relaxed);
    let fallback = format!("kvepp_kv_events_fallback{{endpoint=\"{}\"}}", h.http);
    wait_for("the holder in fallback", || async {
        (epp.metric(&fallback).await? == 1.0).then_some(())
    })
    .await;
    assert!(
        indexed(&epp, h.http).await.is_empty(),
        "what its events said is dropped"
    );
    assert!(epp.metric("kvepp_kv_event_undecodable_total").await >= Some(1.0));

    follow_ups_stay(&envoy, &epp, other, 40).await;
    assert_eq!(
        indexed(&epp, h.http).await,
        Vec::<u64>::new(),
        "nothing it published was read"
    );

    // Its events decode again: out of fallback, its new blocks indexed from its events.
    h.state.garble.store(false, Ordering::Relaxed);
    wait_for("the holder out of fallback", || async {
        (epp.metric(&fallback).await? == 0.0).then_some(())
    })
    .await;
    let x = tokens(90, 3 * BLOCK);
    h.state
        .events
        .send(stored_batch(&h.state.name, BLOCK, &x))
        .unwrap();
    wait_for("its events indexed again", || async {
        (indexed(&epp, h.http).await == epp_hashes(&x)).then_some(())
    })
    .await;
    drop(envoy);
    epp.stop().await;
}

/// Cold prompts go to either engine; each one's follow-up goes where it went: to the engine in
/// fallback by what was routed to it, to `other` by its events. At least three reach the engine
/// in fallback (of at most 24).
async fn follow_ups_stay(envoy: &Envoy, epp: &Epp, other: &Engine, seed: u32) {
    let mut on_fallback = 0;
    for k in 0..24u32 {
        let first = tokens(seed + k, 4 * other.state.block);
        let served = served_by(envoy, &first).await;
        if served == other.state.name {
            let stored = hashes_at(&first, other.state.block);
            wait_for("the other engine's events applied", || async {
                let held = indexed(epp, other.http).await;
                stored.iter().all(|x| held.contains(x)).then_some(())
            })
            .await;
        } else {
            on_fallback += 1;
        }
        let mut next = first.clone();
        next.extend(tokens(seed + 30 + k, 2 * other.state.block));
        assert_eq!(served_by(envoy, &next).await, served, "follow-up {k}");
        if on_fallback >= 3 {
            return;
        }
    }
    panic!("{on_fallback} cold prompts went to the engine in fallback");
}

/// A pool mixing block sizes (16 configured; one engine at 32): the other engine's events are
/// not read (counted as another block size), it is matched by what was routed to it, and the
/// engine at the pool's size by its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_of_another_block_size_is_matched_by_what_was_routed_to_it() {
    let events_port = free_port();
    let a = Engine::start("a", [127, 0, 0, 2].into(), events_port).await;
    let b = Engine::start_with("b", [127, 0, 0, 3].into(), events_port, 2 * BLOCK).await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    let epp = Epp::start(&m, |c| subscribed(c, events_port)).await;
    until_engines_publish(&epp, &[&a, &b]).await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    // b states its block size with its first stored block.
    b.state
        .events
        .send(stored_batch("b", 2 * BLOCK, &tokens(1, 2 * BLOCK)))
        .unwrap();
    let fallback = format!("kvepp_kv_events_fallback{{endpoint=\"{}\"}}", b.http);
    wait_for("b in fallback", || async {
        (epp.metric(&fallback).await? == 1.0).then_some(())
    })
    .await;
    assert_eq!(epp.metric("kvepp_kv_block_size").await, Some(BLOCK as f64));
    follow_ups_stay(&envoy, &epp, &a, 100).await;
    assert!(indexed(&epp, b.http).await.is_empty());
    assert!(
        epp.metric("kvepp_kv_events_dropped_total{reason=\"block_size_mismatch\"}")
            .await
            >= Some(1.0)
    );
    drop(envoy);
    epp.stop().await;
}
