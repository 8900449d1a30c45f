//! The simulated fleet behind a real Envoy and kvepp: the engines' caches and kvepp's KV-event
//! index agree after a run with evictions, and precise KV-aware routing finds more cached prefix
//! than round robin on a shared-prefix workload.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::common::{index_and_caches, tokens};
use kvepp_bench::routing::{self as routing_bench, BenchSpec, Policy};
use kvepp_sim::fleet::{Fleet, FleetSpec, SimParams};
use kvepp_sim::workload;
use kvepp_test_support::prelude::*;

/// Small, fast engines: blocks of 16 tokens, a cache of `blocks` blocks.
fn params(blocks: u64) -> SimParams {
    SimParams {
        model: "m".into(),
        total_kv_blocks: blocks,
        step_overhead_us: 1000.0,
        prefill_us_per_token: 5.0,
        decode_us_per_seq: 10.0,
        ..SimParams::default()
    }
}

/// `engines` engines with `blocks`-block caches, kvepp subscribed to all their KV events, and
/// Envoy in front.
async fn fleet_behind_envoy(engines: usize, blocks: u64) -> (Fleet, Epp, Envoy) {
    let fleet = Fleet::start(FleetSpec {
        engines,
        params: params(blocks),
        pool_name: "pool".into(),
        ..FleetSpec::default()
    })
    .await
    .expect("fleet");
    let epp = Epp::start(&fleet.manifests(), |c| c.engine_metrics.enabled = false).await;
    wait_for("KV event subscriptions to every engine", || async {
        (epp.metric("kvepp_kv_event_subscriptions").await? >= engines as f64).then_some(())
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    (fleet, epp, envoy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_caches_and_the_epp_index_agree_after_evictions() {
    let (fleet, epp, envoy) = fleet_behind_envoy(3, 40).await;
    // 8 prompt families of 6-10 blocks, extended and revisited: 40-block caches must evict.
    let mut served = BTreeMap::<String, u32>::new();
    for i in 0..48u32 {
        let mut prompt = tokens(i % 8, 16 * (6 + (i % 3) as usize));
        prompt.extend(tokens(1000 + i, 16 * ((i % 4) as usize)));
        let (engine, _) = crate::common::complete_as(envoy.addr, "m", &prompt, 2).await;
        *served.entry(engine).or_default() += 1;
    }
    assert!(
        served.len() >= 2,
        "requests spread over engines: {served:?}"
    );
    let removed = wait_for("evictions reported", || async {
        epp.metric("kvepp_kv_event_blocks_removed_total")
            .await
            .filter(|v| *v > 0.0)
    })
    .await;
    assert!(removed > 0.0);
    // Events are asynchronous: the index converges to the caches.
    let (index, caches) = wait_for("kvepp's index equal to the engines' caches", || async {
        let (index, caches) = index_and_caches(&epp, &fleet).await;
        (index == caches).then_some((index, caches))
    })
    .await;
    assert_eq!(index.len(), 3);
    assert!(caches.values().all(|c| c.len() <= 40));
    assert!(
        caches.values().filter(|c| !c.is_empty()).count() >= 2,
        "{caches:?}"
    );
    drop(envoy);
    epp.stop().await;
}

/// A replay on `engines` engines of `blocks`-block caches behind `replicas` kvepp replicas (no
/// replica sync), the first engine restarting at `restart_at` if given.
fn spec(engines: usize, blocks: u64, replicas: usize, restart_at: Option<Duration>) -> BenchSpec {
    BenchSpec {
        layout: Vec::new(),
        engines,
        params: params(blocks),
        envoy: envoy_bin(),
        speed: 1.0,
        drain: Duration::from_secs(60),
        kvepp: kvepp::config::Config::default(),
        replicas,
        replica_sync: false,
        restart_at,
        ips: Vec::new(),
        port: 0,
    }
}

/// Replays `requests` under each policy on `engines` engines of `blocks`-block caches behind
/// `replicas` kvepp replicas (no replica sync); every request must succeed, and the second
/// policy stays within the workload's hit ceiling. The hit ratios and the ceiling.
async fn hit_ratios(
    engines: usize,
    blocks: u64,
    replicas: usize,
    policies: [Policy; 2],
    requests: &[workload::Request],
) -> (Vec<f64>, f64) {
    let spec = spec(engines, blocks, replicas, None);
    let mut hits = Vec::new();
    for policy in policies {
        let routing_bench::Replay {
            records,
            engines: names,
            restart_cleared_after,
            ..
        } = routing_bench::run_policy(&spec, policy, requests)
            .await
            .expect("replay");
        assert_eq!(restart_cleared_after, None, "no restart in this replay");
        let r = routing_bench::report::summarize(policy.name(), &records, &names, 1000.0);
        assert_eq!(r.failed, 0, "{policy:?}: {:?}", r.first_error);
        assert_eq!(r.requests, requests.len());
        hits.push(r.hit_ratio);
    }
    let ceiling = workload::hit_ceiling(requests, 16);
    assert!(hits[1] <= ceiling + 1e-9, "{} > ceiling {ceiling}", hits[1]);
    (hits, ceiling)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn precise_routing_finds_more_cached_prefix_than_round_robin() {
    // 6 system prompts of 32 blocks; each engine caches 80 blocks (two prompts and change), the
    // three engines all six: round robin evicts what precise routing keeps.
    let requests = workload::shared_prefix(&workload::SharedPrefix {
        groups: 6,
        system_tokens: 512,
        user_tokens: 64,
        output_tokens: (2, 4),
        rate: 30.0,
        duration: Duration::from_secs(3),
        seed: 7,
    });
    let (hits, ceiling) =
        hit_ratios(3, 80, 1, [Policy::RoundRobin, Policy::Precise], &requests).await;
    let (rr, precise) = (hits[0], hits[1]);
    eprintln!("hit ratio: round robin {rr:.3}, precise {precise:.3}, ceiling {ceiling:.3}");
    assert!(
        precise > rr + 0.2,
        "precise {precise:.3} vs round robin {rr:.3} (ceiling {ceiling:.3})"
    );
}

/// The replay's restart measurement: with KV events, the report learns when kvepp dropped the
/// restarted engine's blocks (a restart it would not see leaves it None); without them it does
/// not ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_reports_when_kvepp_dropped_a_restarted_engine() {
    let requests = workload::shared_prefix(&workload::SharedPrefix {
        groups: 3,
        system_tokens: 256,
        user_tokens: 32,
        output_tokens: (2, 4),
        rate: 20.0,
        duration: Duration::from_secs(2),
        seed: 3,
    });
    let spec = spec(2, 400, 1, Some(Duration::from_secs(1)));
    for (policy, measured) in [(Policy::Precise, true), (Policy::ApproximatePrefix, false)] {
        let replay = routing_bench::run_policy(&spec, policy, &requests)
            .await
            .expect("replay");
        assert_eq!(
            replay.restart_cleared_after.is_some(),
            measured,
            "{policy:?}: {:?}",
            replay.restart_cleared_after
        );
        assert_eq!(replay.records.len(), requests.len());
    }
}

/// A router running on its own (here a kvepp whose pool lists the fleet's addresses before the
/// fleet exists, as a router watching Kubernetes would) is replayed like a policy: the fleet comes
/// up at one address per engine on one port, the replay waits until the router reaches every
/// engine, and every request is answered through Envoy, each engine taking a share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_of_its_own_is_replayed_like_a_policy() {
    let requests = workload::shared_prefix(&workload::SharedPrefix {
        groups: 4,
        system_tokens: 256,
        user_tokens: 32,
        output_tokens: (2, 4),
        rate: 20.0,
        duration: Duration::from_secs(2),
        seed: 5,
    });
    let ips: Vec<std::net::IpAddr> = vec![[127, 0, 0, 2].into(), [127, 0, 0, 3].into()];
    let port = routing_bench::free_port().expect("a free port");
    // The pool's manifests, from a fleet at the same addresses started and stopped before.
    let fleet_spec = FleetSpec {
        engines: 2,
        params: params(400),
        pool_name: "pool".into(),
        ips: ips.clone(),
        port,
        ..FleetSpec::default()
    };
    let manifests = Fleet::start(fleet_spec.clone())
        .await
        .expect("fleet")
        .manifests();
    for ip in &ips {
        assert!(manifests.contains(&format!("\"{ip}\"")), "{manifests}");
    }
    let epp = Epp::start(&manifests, |c| c.engine_metrics.enabled = false).await;
    let mut spec = spec(2, 400, 1, None);
    spec.ips = ips.clone();
    spec.port = port;
    let replay =
        routing_bench::run_router(&spec, routing_bench::Router::External(epp.grpc), &requests)
            .await
            .expect("replay");
    let r = routing_bench::report::summarize("external", &replay.records, &replay.engines, 1000.0);
    assert_eq!(r.failed, 0, "{:?}", r.first_error);
    assert_eq!(r.requests, requests.len());
    let served: std::collections::BTreeSet<_> = replay
        .records
        .iter()
        .filter_map(|r| r.outcome.engine.clone())
        .collect();
    assert_eq!(served.len(), 2, "both engines served: {served:?}");
    epp.stop().await;

    // A fixed port with fewer addresses than engines cannot bind: said before anything starts.
    let shared = Fleet::start(FleetSpec {
        engines: 3,
        ..fleet_spec
    })
    .await
    .expect_err("three engines on two addresses and one port");
    assert_eq!(
        shared.to_string(),
        format!("a fixed port ({port}) needs an address per engine: 3 engines, 2 addresses")
    );
}

/// One completion of model `m` through Envoy: (engine, cached tokens).
async fn complete(envoy: std::net::SocketAddr, prompt: &[u32], max_tokens: u32) -> (String, u64) {
    let (engine, v) = crate::common::complete_as(envoy, "m", prompt, max_tokens).await;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    (engine, cached.expect("cached tokens"))
}

async fn engines_metric(fleet: &Fleet, series: &str) -> f64 {
    let mut sum = 0.0;
    for e in &fleet.engines {
        let r = http(e.http, "GET", "/metrics", &[], "").await;
        sum += kvepp_test_support::find_sample(&String::from_utf8_lossy(&r.body), series)
            .unwrap_or(0.0);
    }
    sum
}

/// Generated blocks cached and reused by the next turn, running requests' blocks pinned,
/// preemption when the pool runs out, an engine restart: kvepp's index still equals the engines'
/// caches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_generated_blocks_pinning_preemption_and_restarts() {
    let (fleet, epp, envoy) = fleet_behind_envoy(2, 24).await;

    // A conversation: the second turn carries the first prompt and its answer token for token,
    // and finds both cached (precise routing sends it back to the engine that has them).
    let first = tokens(1, 40);
    let (engine, cached) = complete(envoy.addr, &first, 40).await;
    assert_eq!(cached, 0);
    let mut second = first.clone();
    second.extend(kvepp_sim::fleet::cache::generated_tokens(&first, 40));
    second.extend(tokens(2, 8));
    let (again, cached) = complete(envoy.addr, &second, 4).await;
    assert_eq!(again, engine, "the turn follows its cache");
    // 80 tokens of prompt and answer, the last answer token never computed (as in vLLM): 79
    // tokens of KV, 4 full blocks, the third and fourth filled by generated tokens.
    assert_eq!(cached, 64);

    // Eight requests at once, each 3 prompt blocks + 64 generated tokens (7 blocks when done):
    // 56 blocks wanted on two 24-block engines, so running requests are preempted and resume.
    let mut joins = Vec::new();
    for i in 0..8u32 {
        let addr = envoy.addr;
        joins.push(tokio::spawn(async move {
            complete(addr, &tokens(10 + i, 48), 64).await
        }));
    }
    for j in joins {
        j.await.expect("request");
    }
    let preemptions = engines_metric(&fleet, "vllm:num_preemptions_total{model_name=\"m\"}").await;
    assert!(preemptions > 0.0, "no preemption");
    let (index, caches) = wait_for("kvepp's index equal to the engines' caches", || async {
        let (index, caches) = index_and_caches(&epp, &fleet).await;
        (index == caches).then_some((index, caches))
    })
    .await;
    assert!(caches.values().all(|c| !c.is_empty() && c.len() <= 24));

    // A restart empties one engine; kvepp sees a new publisher and forgets that engine's blocks.
    let restarted = &fleet.engines[0];
    let r = http(restarted.http, "POST", "/debug/restart", &[], "").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    wait_for(
        "the restarted engine's blocks gone from the index",
        || async {
            let (index, caches) = index_and_caches(&epp, &fleet).await;
            (index == caches && index[&restarted.http.to_string()].is_empty()).then_some(())
        },
    )
    .await;
    assert!(!index[&restarted.http.to_string()].is_empty());
    // The engine serves again (sent to it directly: through Envoy, cold prompts could all go to
    // the other engine), and its new blocks reach the index under the new numbering.
    for i in 0..4u32 {
        let (engine, _) = complete(restarted.http, &tokens(100 + i, 32), 20).await;
        assert_eq!(engine, restarted.name);
    }
    wait_for("index equal to the caches after the restart", || async {
        let (index, caches) = index_and_caches(&epp, &fleet).await;
        (index == caches && !index[&restarted.http.to_string()].is_empty()).then_some(())
    })
    .await;
    assert!(
        epp.metric("kvepp_kv_event_publisher_restarts_total")
            .await
            .unwrap_or(0.0)
            >= 1.0
    );
    drop(envoy);
    epp.stop().await;
}

/// Two kvepp replicas behind one Envoy, no replica sync, multi-turn conversations: each replica
/// routes about half of a conversation's turns, so the approximate index (what this replica
/// routed) often misses where the previous turn went (a guess among 6 engines), while the
/// engines' KV events tell both replicas. Precise routing finds more of the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_replicas_precise_routing_beats_approximate_on_conversations() {
    let requests = workload::multi_turn(&workload::MultiTurn {
        rate: 8.0,
        duration: Duration::from_secs(3),
        turns: (2, 3),
        // Shorter than a block: conversations share nothing, so a replica that did not route the
        // previous turn has no prefix to go by.
        system_prompts: 2,
        system_tokens: 8,
        user_tokens: (96, 160),
        output_tokens: (32, 64),
        think: Duration::from_millis(50),
        direct_share: 0.0,
        seed: 11,
    });
    let (hits, ceiling) = hit_ratios(
        6,
        400,
        2,
        [Policy::ApproximatePrefix, Policy::Precise],
        &requests,
    )
    .await;
    let (approx, precise) = (hits[0], hits[1]);
    eprintln!("hit ratio, 2 replicas without sync: approximate {approx:.3}, precise {precise:.3}, ceiling {ceiling:.3}");
    assert!(
        precise > approx + 0.1,
        "precise {precise:.3} vs approximate {approx:.3} (ceiling {ceiling:.3})"
    );
}
