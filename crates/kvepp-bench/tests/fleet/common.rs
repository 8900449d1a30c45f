//! Helpers the simulated-fleet tests share: token prompts, and kvepp's KV-event index beside the
//! engines' caches.

use std::collections::BTreeMap;

use kvepp_sim::fleet::Fleet;
use kvepp_test_support::prelude::{http, Epp};

/// `n` distinct tokens of family `seed`.
pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

/// What kvepp's index holds per engine address, and what each engine caches.
pub async fn index_and_caches(
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

/// One completion of `model` at `addr` (Envoy or an engine), answered 200 with every token asked
/// for: the engine that served it and the response.
pub async fn complete_as(
    addr: std::net::SocketAddr,
    model: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> (String, serde_json::Value) {
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": max_tokens});
    let r = http(
        addr,
        "POST",
        "/v1/completions",
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], u64::from(max_tokens));
    let engine = r
        .header(kvepp_sim::fleet::ENGINE_HEADER)
        .expect("engine header");
    (engine.to_owned(), v)
}
