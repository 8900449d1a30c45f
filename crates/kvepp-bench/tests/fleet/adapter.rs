//! LoRA adapters in the simulated fleet: an engine loads adapters into its slots, evicts the least
//! recently used idle one, reports them in `vllm:lora_requests_info` as vLLM does, and its KV
//! events name the adapter, so kvepp's index (hashes seeded by the adapter) equals the caches.

use std::sync::atomic::Ordering;

use crate::common::{index_and_caches, tokens};
use kvepp_sim::fleet::{Fleet, FleetSpec, SimParams};
use kvepp_test_support::prelude::*;

fn params() -> SimParams {
    SimParams {
        model: "m".into(),
        total_kv_blocks: 400,
        step_overhead_us: 1000.0,
        prefill_us_per_token: 5.0,
        decode_us_per_seq: 10.0,
        max_loras: 2,
        lora_load_ms: 5.0,
        ..SimParams::default()
    }
}

async fn complete(addr: std::net::SocketAddr, model: &str, prompt: &[u32], max: u32) -> String {
    crate::common::complete_as(addr, model, prompt, max).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_loads_evicts_and_reports_its_adapters_as_vllm_does() {
    let fleet = Fleet::start(FleetSpec {
        engines: 1,
        params: params(),
        pool_name: "pool".into(),
        ..FleetSpec::default()
    })
    .await
    .expect("fleet");
    let e = &fleet.engines[0];
    let page = || async {
        let r = http(e.http, "GET", "/metrics", &[], "").await;
        String::from_utf8(r.body.to_vec()).expect("utf8")
    };
    let idle = kvepp::engine::lora::parse(&page().await).unwrap().unwrap();
    assert_eq!((idle.max_lora, idle.running.len()), (2, 0));
    // Three adapters one after the other through two slots: three loads, one eviction.
    for (k, a) in ["a", "b", "c"].iter().enumerate() {
        complete(e.http, a, &tokens(k as u32, 32), 2).await;
    }
    let c = &e.core.counters;
    assert_eq!(c.lora_loads.load(Ordering::Relaxed), 3);
    assert_eq!(c.lora_evictions.load(Ordering::Relaxed), 1);
    // While a long request runs, its adapter is listed as running.
    let long = tokio::spawn({
        let addr = e.http;
        async move { complete(addr, "b", &tokens(9, 32), 3000).await }
    });
    let running = wait_for("adapter b reported running", || async {
        let s = kvepp::engine::lora::parse(&page().await).ok()??;
        s.running.iter().any(|n| &**n == "b").then_some(s)
    })
    .await;
    assert!(running.waiting.is_empty());
    // A model that is neither the base nor served as an adapter by an engine without slots: 404.
    let plain = Fleet::start(FleetSpec {
        engines: 1,
        params: SimParams {
            max_loras: 0,
            ..params()
        },
        pool_name: "plain".into(),
        ..FleetSpec::default()
    })
    .await
    .expect("fleet");
    let r = http(
        plain.engines[0].http,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        serde_json::json!({"model": "a", "prompt": [1, 2], "max_tokens": 1}).to_string(),
    )
    .await;
    assert_eq!(r.status, 404);
    assert!(!String::from_utf8_lossy(
        &http(plain.engines[0].http, "GET", "/metrics", &[], "")
            .await
            .body
    )
    .contains("lora_requests_info"));
    long.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_blocks_in_the_caches_equal_kvepps_index() {
    let fleet = Fleet::start(FleetSpec {
        engines: 2,
        params: params(),
        pool_name: "pool".into(),
        ..FleetSpec::default()
    })
    .await
    .expect("fleet");
    let epp = Epp::start(&fleet.manifests(), |c| {
        c.unknown_models = kvepp::config::UnknownModels::PassThrough;
    })
    .await;
    wait_for("KV event subscriptions to both engines", || async {
        (epp.metric("kvepp_kv_event_subscriptions").await? >= 2.0).then_some(())
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    // One prompt under two adapters and the base model: three sets of blocks.
    let shared = tokens(1, 64);
    for model in ["a", "b", "m", "a"] {
        complete(envoy.addr, model, &shared, 2).await;
    }
    let (index, _) = wait_for("kvepp's index equal to the engines' caches", || async {
        let (index, caches) = index_and_caches(&epp, &fleet).await;
        (index == caches).then_some((index, caches))
    })
    .await;
    let blocks: usize = index.values().map(Vec::len).sum();
    assert!(
        blocks >= 12,
        "three adapters' copies of 4 blocks: {index:?}"
    );
    drop(envoy);
    epp.stop().await;
}
