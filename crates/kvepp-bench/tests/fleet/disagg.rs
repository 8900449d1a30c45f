//! Prefill/decode disaggregation end to end: simulated prefill and decode engines in two zones,
//! a real Envoy and kvepp with `kv_transfer_topology_level: zone`. Every decode pick stays in its
//! prefill worker's zone; when a zone loses its decode workers, `fail` answers the error and
//! `fallback` crosses zones; the prefill leg is released at the first response byte and the
//! decode leg at the end of the stream.

use std::collections::HashMap;

use bytes::Bytes;
use http_body_util::BodyExt;
use kvepp_core::MismatchPolicy;
use kvepp_sim::fleet::{
    EngineLayout, Fleet, FleetSpec, SimParams, ENGINE_HEADER, PREFILLED_BY_HEADER,
};
use kvepp_test_support::prelude::*;

fn params() -> SimParams {
    SimParams {
        model: "m".into(),
        total_kv_blocks: 4000,
        step_overhead_us: 1000.0,
        prefill_us_per_token: 5.0,
        decode_us_per_seq: 10.0,
        ..SimParams::default()
    }
}

/// Engines 0, 1 prefill (zones a, b); engines 2, 3 decode (zones a, b).
async fn fleet() -> Fleet {
    Fleet::start(FleetSpec {
        engines: 4,
        params: params(),
        pool_name: "pool".into(),
        layout: EngineLayout::disaggregated(2, 2, &["a".into(), "b".into()]),
        ..FleetSpec::default()
    })
    .await
    .expect("fleet")
}

/// The ready endpoints by role, as `/debug/endpoints` reports them.
async fn roles(epp: &Epp) -> HashMap<String, Vec<String>> {
    let r = http(epp.metrics, "GET", "/debug/endpoints", &[], "").await;
    assert_eq!(r.status, 200);
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    for e in r.json()["endpoints"].as_array().expect("list") {
        out.entry(e["role"].as_str().expect("role").to_owned())
            .or_default()
            .push(e["addr"].as_str().expect("addr").to_owned());
    }
    out
}

async fn in_flight(epp: &Epp) -> HashMap<String, u64> {
    let r = http(epp.metrics, "GET", "/debug/endpoints", &[], "").await;
    r.json()["endpoints"]
        .as_array()
        .expect("list")
        .iter()
        .map(|e| {
            (
                e["addr"].as_str().expect("addr").to_owned(),
                e["in_flight"].as_u64().expect("count"),
            )
        })
        .collect()
}

fn body(i: u32, stream: bool, max_tokens: u32) -> String {
    let prompt: Vec<u32> = (0..160).map(|t| i * 1000 + t).collect();
    serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
        .to_string()
}

async fn start(policy: MismatchPolicy) -> (Fleet, Epp, Envoy, HashMap<String, String>) {
    let fleet = fleet().await;
    let epp = Epp::start(&fleet.manifests(), |c| {
        c.engine_metrics.enabled = false;
        c.disaggregation.kv_transfer_topology_level = Some("zone".into());
        c.disaggregation.kv_transfer_mismatch_policy = policy;
    })
    .await;
    wait_for("every endpoint's role from its /metadata", || async {
        let r = roles(&epp).await;
        (r.get("prefill").map(Vec::len) == Some(2) && r.get("decode").map(Vec::len) == Some(2))
            .then_some(())
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    // Engine name and address → zone.
    let mut zone = HashMap::new();
    for e in &fleet.engines {
        let z = e.layout.domains["zone"].clone();
        zone.insert(e.name.clone(), z.clone());
        zone.insert(e.http.to_string(), z);
    }
    (fleet, epp, envoy, zone)
}

async fn post(envoy: &Envoy, body: String) -> HttpResponse {
    http(
        envoy.addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body,
    )
    .await
}

/// Every pick pairs within a zone, both zones serve, and the pair metric says so.
async fn pairs_stay_in_their_zone(epp: &Epp, envoy: &Envoy, zone: &HashMap<String, String>) {
    let mut zones_used = std::collections::BTreeSet::new();
    for i in 0..20 {
        let r = post(envoy, body(i, false, 2)).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let decode = r.header(ENGINE_HEADER).expect("served by an engine");
        let prefill = r
            .header(PREFILLED_BY_HEADER)
            .expect("the decode engine pulled the KV cache from a prefill engine");
        assert_eq!(
            zone[decode], zone[prefill],
            "request {i}: {prefill} → {decode}"
        );
        zones_used.insert(zone[decode].clone());
    }
    assert_eq!(zones_used.len(), 2, "both zones' pairs serve");
    let text = epp.metrics_text().await;
    for (p, d, want_some) in [
        ("a", "a", true),
        ("b", "b", true),
        ("a", "b", false),
        ("b", "a", false),
    ] {
        let series =
            format!("kvepp_pd_pairs_total{{prefill_domain=\"{p}\",decode_domain=\"{d}\"}}");
        let n = kvepp_test_support::find_sample(&text, &series).unwrap_or(0.0);
        assert_eq!(n > 0.0, want_some, "{series} = {n}");
    }
}

/// The prefill leg is released when the response starts, the decode leg at its end.
async fn bookings_are_released(epp: &Epp, envoy: &Envoy, fleet: &Fleet) {
    let resp = kvepp_test_support::client::request(
        envoy.addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        Bytes::from(body(99, true, 400)),
    )
    .await
    .expect("response");
    assert_eq!(resp.status(), 200);
    let decode = resp.headers()[ENGINE_HEADER]
        .to_str()
        .expect("name")
        .to_owned();
    let prefill = resp.headers()[PREFILLED_BY_HEADER]
        .to_str()
        .expect("addr")
        .to_owned();
    let decode_addr = fleet
        .engines
        .iter()
        .find(|e| e.name == decode)
        .expect("engine")
        .http
        .to_string();
    let mut body = resp.into_body();
    // The stream is running: only its decode worker holds it.
    wait_for(
        "prefill leg released at the first response byte",
        || async {
            let f = in_flight(epp).await;
            (f[&prefill] == 0 && f[&decode_addr] == 1).then_some(())
        },
    )
    .await;
    while let Some(frame) = body.frame().await {
        frame.expect("frame");
    }
    wait_for("decode leg released at the end of the stream", || async {
        in_flight(epp).await.values().all(|n| *n == 0).then_some(())
    })
    .await;
}

/// Zone b loses its decode worker and zone a its prefill worker: the one prefill worker left
/// (zone b) has no decode worker in its zone.
async fn lose_a_zone(epp: &Epp, fleet: &Fleet) {
    epp.write_manifest(
        "pool.yaml",
        &fleet.manifests_of(|e| e.name == "sim-engine-1" || e.name == "sim-engine-2"),
    );
    wait_for("two endpoints left", || async {
        let r = roles(epp).await;
        (r.values().map(Vec::len).sum::<usize>() == 2).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_policy_keeps_transfers_in_zone_and_refuses_when_it_cannot() {
    let (fleet, epp, envoy, zone) = start(MismatchPolicy::Fail).await;
    pairs_stay_in_their_zone(&epp, &envoy, &zone).await;
    bookings_are_released(&epp, &envoy, &fleet).await;
    lose_a_zone(&epp, &fleet).await;
    let r = post(&envoy, body(500, false, 2)).await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    let err = r.json();
    let message = err["error"]["message"].as_str().expect("message");
    assert!(message.contains("zone \"b\""), "{message}");
    assert!(
        message.contains("kv_transfer_mismatch_policy is fail"),
        "{message}"
    );
    let refused = epp
        .metric("kvepp_rejected_requests_total{reason=\"topology_mismatch\"}")
        .await;
    assert_eq!(refused, Some(1.0));
    drop(envoy);
    epp.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_policy_crosses_zones_when_it_must() {
    let (fleet, epp, envoy, zone) = start(MismatchPolicy::Fallback).await;
    pairs_stay_in_their_zone(&epp, &envoy, &zone).await;
    lose_a_zone(&epp, &fleet).await;
    for i in 0..3 {
        let r = post(&envoy, body(600 + i, false, 2)).await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let prefill = r.header(PREFILLED_BY_HEADER).expect("paired");
        let decode = r.header(ENGINE_HEADER).expect("engine");
        assert_eq!((zone[prefill].as_str(), zone[decode].as_str()), ("b", "a"));
    }
    assert_eq!(epp.metric("kvepp_pd_cross_domain_total").await, Some(3.0));
    assert!(epp
        .metric("kvepp_pd_pairs_total{prefill_domain=\"b\",decode_domain=\"a\"}")
        .await
        .is_some_and(|n| n >= 3.0));
    drop(envoy);
    epp.stop().await;
}
