//! Data parallelism through a real Envoy: an `inference.networking.k8s.io/v1` InferencePool with
//! two `targetPorts` makes each (pod, port) an endpoint, each matched to its own rank's KV events
//! (the pod's `/metadata` lists one publisher per rank), so a prompt one rank cached is routed to
//! that rank's port.

use std::net::SocketAddr;

use kvepp_sim::fleet::{Fleet, FleetSpec, SimParams, ENGINE_HEADER};
use kvepp_test_support::prelude::*;

/// The pod's `/metadata` (one document for both ranks, as the worker-agent of a data-parallel
/// vLLM serves it): a publisher per rank.
async fn pod_metadata(fleet: &Fleet) -> SocketAddr {
    let doc = serde_json::json!({
        "model": {"name": "m", "runtime_config": {"block_size": 16, "data_parallel_size": 2}},
        "kv_events": {
            "endpoints": {"0": fleet.engines[0].kv_events.endpoint, "1": fleet.engines[1].kv_events.endpoint},
            "replay_endpoints": {"0": fleet.engines[0].kv_events.replay_endpoint,
                                 "1": fleet.engines[1].kv_events.replay_endpoint}},
    })
    .to_string();
    let app = axum::Router::new().route(
        "/metadata",
        axum::routing::get(move || {
            let doc = doc.clone();
            async move { ([("content-type", "application/json")], doc) }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

fn manifests(ports: [u16; 2], metadata: u16) -> String {
    format!(
        "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {{name: pool}}\n\
         spec:\n  selector: {{matchLabels: {{app: dp}}}}\n  targetPorts: [{{number: {}}}, {{number: {}}}]\n  \
         endpointPickerRef: {{name: kvepp, port: {{number: 9002}}}}\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
         metadata: {{name: dp-pod, labels: {{kubernetes.io/service-name: pool}}}}\naddressType: IPv4\n\
         endpoints:\n- addresses: [\"127.0.0.1\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: dp-pod}}\n\
         ports:\n- {{name: metadata, port: {metadata}, protocol: TCP}}\n",
        ports[0], ports[1]
    )
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..128).map(|i| seed * 10_000 + i).collect()
}

fn body(seed: u32) -> String {
    serde_json::json!({"model": "m", "prompt": prompt(seed), "max_tokens": 1}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_target_ports_are_two_ranks_routed_by_their_own_kv_events() {
    // Two engines on one address: the pod's two data-parallel ranks.
    let fleet = Fleet::start(FleetSpec {
        engines: 2,
        params: SimParams {
            model: "m".into(),
            step_overhead_us: 500.0,
            prefill_us_per_token: 1.0,
            ..SimParams::default()
        },
        ..FleetSpec::default()
    })
    .await
    .expect("fleet");
    let md = pod_metadata(&fleet).await;
    let ports = [fleet.engines[0].http.port(), fleet.engines[1].http.port()];
    let epp = Epp::start(&manifests(ports, md.port()), |c| {
        c.engine_metrics.enabled = false;
        c.unknown_models = kvepp::config::UnknownModels::PassThrough;
    })
    .await;
    let r = http(epp.metrics, "GET", "/debug/endpoints", &[], "").await;
    let eps = r.json()["endpoints"].as_array().unwrap().clone();
    let mut seen: Vec<(String, String, u64)> = eps
        .iter()
        .map(|e| {
            (
                e["addr"].as_str().unwrap().to_owned(),
                e["name"].as_str().unwrap().to_owned(),
                e["data_parallel_rank"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut want = vec![
        (
            format!("127.0.0.1:{}", ports[0]),
            "dp-pod-rank-0".to_owned(),
            0,
        ),
        (
            format!("127.0.0.1:{}", ports[1]),
            "dp-pod-rank-1".to_owned(),
            1,
        ),
    ];
    want.sort();
    seen.sort();
    assert_eq!(
        seen, want,
        "one endpoint per (pod, port), the port's index its rank"
    );
    wait_for("one KV-event subscription per rank", || async {
        (epp.metric("kvepp_kv_event_subscriptions").await? == 2.0).then_some(())
    })
    .await;
    // Each rank caches its own prompt (sent to it directly, past the EPP).
    for (rank, seed) in [(0usize, 1u32), (1, 2)] {
        let r = post_json(fleet.engines[rank].http, body(seed)).await;
        assert_eq!(r.status, 200);
    }
    wait_for("both ranks' blocks in kvepp's index", || async {
        let r = http(epp.metrics, "GET", "/debug/kv-index", &[], "").await;
        let eps = r.json()["endpoints"].clone();
        let n = |p: u16| {
            eps[format!("127.0.0.1:{p}")]["blocks"]
                .as_array()
                .map_or(0, Vec::len)
        };
        (n(ports[0]) >= 8 && n(ports[1]) >= 8).then_some(())
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    for _ in 0..3 {
        for (rank, seed) in [(1usize, 2u32), (0, 1)] {
            let r = http(
                envoy.addr,
                "POST",
                "/v1/completions",
                &[("content-type", "application/json")],
                body(seed),
            )
            .await;
            assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
            assert_eq!(
                r.header(ENGINE_HEADER),
                Some(fleet.engines[rank].name.as_str()),
                "prompt {seed} goes to the rank that cached it"
            );
        }
    }
    drop(envoy);
    epp.stop().await;
}
