//! The simulated fleet behind a real Envoy and kvepp: the engines' caches and kvepp's KV-event
//! index agree after a run with evictions, and precise KV-aware routing finds more cached prefix
//! than round robin on a shared-prefix workload.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// The EPP suite's harness (in-process kvepp, real Envoy, HTTP helpers).
#[path = "../../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use kvepp_sim::bench::{self as routing_bench, workload, BenchSpec, Policy};
use kvepp_sim::fleet::{Fleet, FleetSpec, SimParams};

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

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

/// What kvepp's index holds per engine address, and what each engine caches.
async fn index_and_caches(
    epp: &Epp,
    fleet: &Fleet,
) -> (BTreeMap<String, Vec<u64>>, BTreeMap<String, Vec<u64>>) {
    let r = http(epp.metrics, "GET", "/debug/kv-index", &[], "").await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let index: BTreeMap<String, Vec<u64>> = r.json()["endpoints"]
        .as_object()
        .expect("endpoints")
        .iter()
        .map(|(addr, v)| {
            (
                addr.clone(),
                serde_json::from_value(v["blocks"].clone()).expect("blocks"),
            )
        })
        .collect();
    let mut caches = BTreeMap::new();
    for e in &fleet.engines {
        let r = http(e.http, "GET", "/debug/cache", &[], "").await;
        assert_eq!(r.status, 200);
        caches.insert(
            e.http.to_string(),
            serde_json::from_value(r.json()["blocks"].clone()).expect("blocks"),
        );
    }
    (index, caches)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_caches_and_the_epp_index_agree_after_evictions() {
    let fleet = Fleet::start(FleetSpec {
        engines: 3,
        params: params(40),
        pool_name: "pool".into(),
        ..FleetSpec::default()
    })
    .await
    .expect("fleet");
    let epp = Epp::start(&fleet.manifests(), |c| c.engine_metrics.enabled = false).await;
    wait_for("KV event subscriptions to the three engines", || async {
        (epp.metric("kvepp_kv_event_subscriptions").await? >= 3.0).then_some(())
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    // 8 prompt families of 6-10 blocks, extended and revisited: 40-block caches must evict.
    let mut served = BTreeMap::<String, u32>::new();
    for i in 0..48u32 {
        let mut prompt = tokens(i % 8, 16 * (6 + (i % 3) as usize));
        prompt.extend(tokens(1000 + i, 16 * ((i % 4) as usize)));
        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 2});
        let r = http(
            envoy.addr,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        assert_eq!(r.json()["usage"]["completion_tokens"], 2);
        *served
            .entry(
                r.header(kvepp_sim::fleet::ENGINE_HEADER)
                    .expect("engine header")
                    .to_owned(),
            )
            .or_default() += 1;
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
    let spec = BenchSpec {
        layout: Vec::new(),
        engines: 3,
        params: params(80),
        envoy: envoy_bin(),
        speed: 1.0,
        drain: Duration::from_secs(60),
        kvepp: kvepp::config::Config::default(),
        replicas: 1,
        replica_sync: false,
        restart_at: None,
    };
    let mut hits = Vec::new();
    for policy in [Policy::RoundRobin, Policy::Precise] {
        let (records, engines) = routing_bench::run_policy(&spec, policy, &requests)
            .await
            .expect("replay");
        let r = routing_bench::report::summarize(policy.name(), &records, &engines, 1000.0);
        assert_eq!(r.failed, 0, "{policy:?}: {:?}", r.first_error);
        assert_eq!(r.requests, requests.len());
        hits.push(r.hit_ratio);
    }
    let ceiling = workload::hit_ceiling(&requests, 16);
    let (rr, precise) = (hits[0], hits[1]);
    eprintln!("hit ratio: round robin {rr:.3}, precise {precise:.3}, ceiling {ceiling:.3}");
    assert!(
        precise > rr + 0.2,
        "precise {precise:.3} vs round robin {rr:.3} (ceiling {ceiling:.3})"
    );
    assert!(precise <= ceiling + 1e-9, "{precise} > ceiling {ceiling}");
}
