//! Kubernetes discovery through the real `kube::Client` against a wire-level fake API server
//! (`kvepp_test_support::kube_api`): EndpointSlice watch semantics across dropped connections and 410 Gone,
//! InferencePool/InferenceModel changes routing real requests through Envoy, and the worker-agent's
//! readiness flipping a slice (the test plays the endpoints controller).
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvepp::discovery::kubernetes::{client, KubeDiscovery, WatchMetrics};
use kvepp::discovery::{InstanceEvent, InstanceStream, ServiceDiscovery};
use kvepp_test_support::kube_api::*;
use kvepp_test_support::prelude::*;
use kvepp_test_support::TempDir;

async fn next(w: &mut InstanceStream) -> InstanceEvent {
    tokio::time::timeout(DEADLINE, w.next())
        .await
        .expect("a discovery event in time")
        .expect("stream open")
}

fn added(ev: &InstanceEvent) -> Option<&str> {
    match ev {
        InstanceEvent::Added(i) => Some(&i.id),
        _ => None,
    }
}

/// Reads events until `marker` (an Added id) arrives; returns everything before it.
async fn until_added(w: &mut InstanceStream, marker: &str) -> Vec<InstanceEvent> {
    let mut out = Vec::new();
    loop {
        let ev = next(w).await;
        if added(&ev) == Some(marker) {
            return out;
        }
        out.push(ev);
    }
}

fn ids(events: &[InstanceEvent]) -> Vec<String> {
    events
        .iter()
        .map(|e| match e {
            InstanceEvent::Added(i) => format!("+{}", i.id),
            InstanceEvent::Removed(id) => format!("-{id}"),
            InstanceEvent::Synced => "synced".into(),
        })
        .collect()
}

/// A slice of Service `pool` (ports http 8000, metadata 8090).
fn put_pool(api: &FakeApi, name: &str, eps: &[(&str, &str, bool)]) {
    api.put(SLICES, slice(name, "pool", 8000, Some(8090), eps));
}

#[tokio::test]
async fn endpointslice_watch_follows_readiness_reconnects_and_410() {
    let api = FakeApi::start().await;
    let dir = TempDir::new("kube");
    put_pool(
        &api,
        "pool-a",
        &[("10.0.0.1", "pod-1", true), ("10.0.0.2", "pod-2", false)],
    );
    api.put(
        SLICES,
        slice(
            "other-x",
            "other",
            8000,
            None,
            &[("10.0.0.9", "pod-9", true)],
        ),
    );
    let metrics = WatchMetrics::default();
    let disc = KubeDiscovery::new(
        client(Some(&api.kubeconfig(dir.path()))).await.unwrap(),
        metrics.clone(),
    );

    // Initial list: the ready pod of this Service only, then Synced.
    let mut w = disc.watch("default", "pool");
    let first = next(&mut w).await;
    let InstanceEvent::Added(p1) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(
        (
            &*p1.id,
            p1.ip.to_string().as_str(),
            p1.port,
            p1.metadata_port
        ),
        ("pod-1", "10.0.0.1", Some(8000), Some(8090))
    );
    assert_eq!(
        (p1.zone.as_deref(), p1.node.as_deref()),
        (Some("zone-a"), Some("node-1"))
    );
    assert_eq!(next(&mut w).await, InstanceEvent::Synced);
    let listed = disc.list_instances("default", "pool").await.unwrap();
    assert_eq!(listed.iter().map(|i| &*i.id).collect::<Vec<_>>(), ["pod-1"]);

    // Readiness flips are Added / Removed.
    put_pool(
        &api,
        "pool-a",
        &[("10.0.0.1", "pod-1", true), ("10.0.0.2", "pod-2", true)],
    );
    assert_eq!(added(&next(&mut w).await), Some("pod-2"));
    put_pool(
        &api,
        "pool-a",
        &[("10.0.0.1", "pod-1", false), ("10.0.0.2", "pod-2", true)],
    );
    assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-1".into()));

    // A pod in two slices is one instance: a second listing adds nothing, deleting one slice
    // removes nothing.
    put_pool(
        &api,
        "pool-b",
        &[("10.0.0.2", "pod-2", true), ("10.0.0.3", "pod-3", true)],
    );
    assert_eq!(added(&next(&mut w).await), Some("pod-3"));
    api.delete(SLICES, "pool-a");
    put_pool(&api, "pool-c", &[("10.0.0.4", "pod-4", true)]);
    assert!(
        until_added(&mut w, "pod-4").await.is_empty(),
        "slice deletion kept pod-2 (still in pool-b)"
    );
    // Terminating endpoints take no new work.
    let mut term = slice(
        "pool-c",
        "pool",
        8000,
        Some(8090),
        &[("10.0.0.4", "pod-4", true)],
    );
    term["endpoints"][0]["conditions"]["terminating"] = true.into();
    api.put(SLICES, term);
    assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-4".into()));

    // The watch connection drops mid-stream; changes made meanwhile arrive once after the
    // watcher resumes from its resourceVersion, without a relist.
    let (lists, watches) = (api.lists(SLICES), api.watches(SLICES));
    api.drop_watches();
    put_pool(
        &api,
        "pool-c",
        &[("10.0.0.4", "pod-4", true), ("10.0.0.5", "pod-5", true)],
    );
    let before = until_added(&mut w, "pod-5").await;
    assert_eq!(
        ids(&before),
        ["+pod-4"],
        "pod-4 is ready again; nothing else changed"
    );
    assert!(api.watches(SLICES) > watches, "the watch was reopened");
    assert_eq!(
        api.lists(SLICES),
        lists,
        "a resumable watch does not relist"
    );

    // 410 Gone: history compacted while disconnected; the watcher relists and only the real
    // differences come out (no duplicate of pod-2/3/4, no lost pod-6, pod-3 removed once).
    api.drop_watches();
    api.compact();
    put_pool(
        &api,
        "pool-b",
        &[
            ("10.0.0.2", "pod-2", true),
            ("10.0.0.3", "pod-3", false),
            ("10.0.0.6", "pod-6", true),
        ],
    );
    api.compact();
    let relists = metrics
        .relists
        .get_or_create(&kvepp::metrics::ResourceLabels {
            resource: "endpointslices",
        })
        .get();
    let before = until_added(&mut w, "pod-6").await;
    assert_eq!(ids(&before), ["-pod-3"]);
    assert!(api.lists(SLICES) > lists, "410 forced a relist");
    let after_relists = metrics
        .relists
        .get_or_create(&kvepp::metrics::ResourceLabels {
            resource: "endpointslices",
        })
        .get();
    assert!(after_relists > relists, "relist counted");
    let now: BTreeSet<String> = disc
        .list_instances("default", "pool")
        .await
        .unwrap()
        .iter()
        .map(|i| i.id.to_string())
        .collect();
    assert_eq!(
        now,
        ["pod-2", "pod-4", "pod-5", "pod-6"]
            .map(String::from)
            .into()
    );
}

/// A backend per pod (on its own port, so one slice each), and the slices the endpoints
/// controller would write for them.
struct Pods {
    addrs: Vec<(String, SocketAddr)>,
    /// Where the slices say `/metadata` is; nothing listens there.
    dead_metadata_port: u16,
}

impl Pods {
    fn put(&self, api: &FakeApi, ready: &[bool]) {
        for ((pod, addr), r) in self.addrs.iter().zip(ready) {
            api.put(
                SLICES,
                slice(
                    &format!("pool-{pod}"),
                    "pool",
                    addr.port(),
                    Some(self.dead_metadata_port),
                    &[("127.0.0.1", pod, *r)],
                ),
            );
        }
    }
}

async fn served_by(
    envoy: &Envoy,
    model: &str,
    n: usize,
) -> (BTreeSet<String>, Vec<u16>, Vec<Option<String>>) {
    let mut seen = BTreeSet::new();
    let mut codes = Vec::new();
    let mut models = Vec::new();
    for i in 0..n {
        let r = http(
            envoy.addr,
            "POST",
            "/v1/completions",
            &[("content-type", "application/json")],
            format!("{{\"model\":\"{model}\",\"prompt\":\"k8s {i}\"}}"),
        )
        .await;
        codes.push(r.status);
        if r.status == 200 {
            let j = r.json();
            seen.insert(j["backend"].as_str().unwrap_or_default().to_owned());
            models.push(j["model"].as_str().map(str::to_owned));
        }
    }
    (seen, codes, models)
}

#[tokio::test]
async fn kubeconfig_epp_routes_to_exactly_the_ready_pods_and_follows_models() {
    let api = FakeApi::start().await;
    let names = ["pod-a", "pod-b", "pod-c"];
    let addrs = echo_backends(&names).await;
    let pods = Pods {
        addrs: names
            .iter()
            .map(|n| n.to_string())
            .zip(addrs.clone())
            .collect(),
        dead_metadata_port: free_port(),
    };
    api.put(POOLS_V1, pool_v1("pool", 8000));
    api.set_missing(POOLS_V1ALPHA2, true); // only the v1 CRD is installed
    api.put(MODELS, model("chat", "chat", "pool", &[]));
    api.put(MODELS, model("foreign", "foreign", "other-pool", &[]));
    pods.put(&api, &[true, true, false]);
    let dir = TempDir::new("kube-epp");
    let kubeconfig = api.kubeconfig(dir.path());
    let epp = Epp::start("", |c| {
        c.manifests_dir = None;
        c.kubeconfig = Some(kubeconfig);
        c.engine_metrics.enabled = false;
        // The pool's endpointPickerRef names Service kvepp: this picker.
        c.endpoint_picker_service = Some("kvepp".into());
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;

    let (seen, codes, _) = served_by(&envoy, "chat", 16).await;
    assert!(codes.iter().all(|c| *c == 200), "{codes:?}");
    assert_eq!(
        seen,
        ["pod-a", "pod-b"].map(String::from).into(),
        "only the ready pods"
    );
    let (_, codes, _) = served_by(&envoy, "foreign", 1).await;
    assert_eq!(codes, [404], "models of other pools are ignored");
    // Their /metadata cannot be fetched: routed with defaults (above), and marked.
    let series = format!(
        "kvepp_endpoint_metadata_missing{{endpoint=\"{}\"}}",
        addrs[0]
    );
    wait_for("metadata marked missing", || async {
        (epp.metric(&series).await == Some(1.0)).then_some(())
    })
    .await;

    // Pods come and go.
    let t = Instant::now();
    pods.put(&api, &[false, true, true]);
    wait_for("pod-a out, pod-c in", || async {
        let (seen, _, _) = served_by(&envoy, "chat", 8).await;
        (seen == ["pod-b", "pod-c"].map(String::from).into()).then_some(())
    })
    .await;
    eprintln!("pods followed in {:?}", t.elapsed());
    api.delete(SLICES, "pool-pod-b");
    wait_for("pod-b's slice deleted", || async {
        let (seen, _, _) = served_by(&envoy, "chat", 8).await;
        (seen == ["pod-c"].map(String::from).into()).then_some(())
    })
    .await;

    // InferenceModel added, changed, deleted.
    api.put(
        MODELS,
        model("review", "review", "pool", &[("review-v1", 1)]),
    );
    let models = wait_for("model added", || async {
        let (_, codes, models) = served_by(&envoy, "review", 1).await;
        (codes == [200]).then_some(models)
    })
    .await;
    assert_eq!(
        models,
        [Some("review-v1".to_owned())],
        "target model rewrite"
    );
    api.put(
        MODELS,
        model("review", "review", "pool", &[("review-v2", 1)]),
    );
    wait_for("model changed", || async {
        let (_, _, models) = served_by(&envoy, "review", 1).await;
        (models == [Some("review-v2".to_owned())]).then_some(())
    })
    .await;
    let t = Instant::now();
    api.delete(MODELS, "review");
    wait_for("model deleted → 404", || async {
        let (_, codes, _) = served_by(&envoy, "review", 1).await;
        (codes == [404]).then_some(())
    })
    .await;
    eprintln!("model deletion followed in {:?}", t.elapsed());

    // InferenceObjective (llm-d.ai/v1alpha2) added, changed to another pool, deleted; the request
    // names it in x-llm-d-inference-objective.
    let with_objective = |name: &'static str| {
        let addr = envoy.addr;
        async move {
            http(
                addr,
                "POST",
                "/v1/completions",
                &[
                    ("content-type", "application/json"),
                    ("x-llm-d-inference-objective", name),
                ],
                r#"{"model":"chat","prompt":"objective"}"#,
            )
            .await
        }
    };
    let r = with_objective("gold").await;
    assert_eq!(r.status, 404, "an objective the pool does not have");
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("InferenceObjective \"gold\""));
    api.put(OBJECTIVES, objective("gold", 5, "pool"));
    wait_for("objective added", || async {
        (with_objective("gold").await.status == 200).then_some(())
    })
    .await;
    api.put(OBJECTIVES, objective("gold", 5, "other-pool"));
    wait_for("objective moved to another pool → 404", || async {
        (with_objective("gold").await.status == 404).then_some(())
    })
    .await;
    api.put(OBJECTIVES, objective("gold", -1, "pool"));
    wait_for("objective back", || async {
        (with_objective("gold").await.status == 200).then_some(())
    })
    .await;
    api.delete(OBJECTIVES, "gold");
    wait_for("objective deleted → 404", || async {
        (with_objective("gold").await.status == 404).then_some(())
    })
    .await;

    // InferenceModelRewrite under both groups: added, changed, deleted. The alias needs no
    // InferenceModel; an invalid rewrite (weights summing to 0) is ignored and counted.
    api.put(
        REWRITES_LLMD,
        rewrite("alias", "pool", Some("assistant"), "chat"),
    );
    let models = wait_for("llm-d.ai rewrite added", || async {
        let (_, codes, models) = served_by(&envoy, "assistant", 1).await;
        (codes == [200]).then_some(models)
    })
    .await;
    assert_eq!(models, [Some("chat".to_owned())]);
    api.put(
        REWRITES_X,
        rewrite("fallback", "pool", None, "chat-fallback"),
    );
    wait_for("inference.networking.x-k8s.io catch-all added", || async {
        let (_, codes, models) = served_by(&envoy, "foreign", 1).await;
        (codes == [200] && models == [Some("chat-fallback".to_owned())]).then_some(())
    })
    .await;
    let invalid = epp.metric("kvepp_catalog_invalid_objects_total").await;
    let mut zero = rewrite("zero", "pool", Some("z"), "z-v1");
    zero["spec"]["rules"][0]["targets"][0]["weight"] = 0.into();
    api.put(REWRITES_LLMD, zero);
    wait_for("the zero-weight rewrite counted as invalid", || async {
        (epp.metric("kvepp_catalog_invalid_objects_total").await > invalid).then_some(())
    })
    .await;
    let (_, _, models) = served_by(&envoy, "z", 1).await;
    assert_eq!(
        models,
        [Some("chat-fallback".to_owned())],
        "ignored: the catch-all takes z"
    );
    api.delete(REWRITES_X, "fallback");
    api.delete(REWRITES_LLMD, "alias");
    wait_for("rewrites deleted → 404", || async {
        let (_, codes, _) = served_by(&envoy, "assistant", 1).await;
        (codes == [404]).then_some(())
    })
    .await;

    // The watch drops and history is compacted: after the relist, the same pods, no duplicates.
    api.drop_watches();
    api.compact();
    pods.put(&api, &[true, false, true]);
    wait_for("after 410: pod-a and pod-c", || async {
        let (seen, _, _) = served_by(&envoy, "chat", 8).await;
        (seen == ["pod-a", "pod-c"].map(String::from).into()).then_some(())
    })
    .await;
    assert_eq!(epp.metric("kvepp_ready_endpoints").await, Some(2.0));
    let text = epp.metrics_text().await;
    assert!(
        text.contains("kvepp_discovery_relists_total{resource=\"endpointslices\"}"),
        "{text}"
    );
    epp.stop().await;
}

#[tokio::test]
async fn readiness_waits_for_the_first_sync() {
    let api = FakeApi::start().await;
    let dir = TempDir::new("kube-ready");
    api.put(POOLS_V1ALPHA2, serde_json::json!({"metadata": {"name": "pool"}, "spec": {"targetPortNumber": 8000, "selector": {"app": "x"}}}));
    // No InferenceModel CRD at all: the catalog still syncs (empty).
    api.set_missing(MODELS, true);
    api.set_missing(SLICES, true);
    let kubeconfig = api.kubeconfig(dir.path());
    let cfg = kube_config(kubeconfig, |_| {});
    let listeners = kvepp::server::Listeners::bind(&cfg).await.unwrap();
    let [_, _, metrics] = listeners.addrs().map(Option::unwrap);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvepp::server::run(cfg, listeners, async {
        let _ = stopped.await;
    }));
    // Slices cannot be listed (404 on discovery.k8s.io): pool known, endpoints not synced → 503.
    wait_for("catalog synced", || async {
        let t = String::from_utf8(
            http(metrics, "GET", "/metrics", &[], "")
                .await
                .body
                .to_vec(),
        )
        .ok()?;
        t.contains("kvepp_discovery_watch_errors_total{resource=\"endpointslices\"}")
            .then_some(())
    })
    .await;
    let r = http(metrics, "GET", "/ready", &[], "").await;
    assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
    api.set_missing(SLICES, false);
    api.put(
        SLICES,
        slice("pool-1", "pool", 8000, None, &[("127.0.0.1", "p", true)]),
    );
    wait_for("ready after the first full sync", || async {
        (http(metrics, "GET", "/ready", &[], "").await.status == 200).then_some(())
    })
    .await;
    let _ = stop.send(());
    task.await.unwrap().unwrap();
}

/// The engine's own health endpoint, switchable.
async fn engine_health(healthy: Arc<AtomicBool>) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let app = axum::Router::new().route(
        "/health",
        axum::routing::get(move || {
            let ok = healthy.load(Ordering::SeqCst);
            async move {
                if ok {
                    axum::http::StatusCode::OK
                } else {
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

#[tokio::test]
async fn worker_agent_readiness_flips_the_slice_and_serves_metadata() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: kvepp::agent::AgentArgs,
    }
    let api = FakeApi::start().await;
    let dir = TempDir::new("agent");
    let healthy = Arc::new(AtomicBool::new(true));
    let engine = engine_health(healthy.clone()).await;
    let backend = echo_backends(&["pod-w"]).await[0];

    // Without the component label, registration fails clearly.
    let labels = dir.path().join("labels");
    std::fs::write(&labels, "app=\"vllm\"\n").unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let agent_addr = l.local_addr().unwrap();
    let args = |extra: &[&str]| {
        let mut v: Vec<String> = [
            "x",
            "--component",
            "pool",
            "--namespace",
            "default",
            "--pod-name",
            "pod-w",
        ]
        .map(String::from)
        .into();
        v.extend(["--labels-file".into(), labels.display().to_string()]);
        v.extend([
            "--engine-health-url".into(),
            format!("http://{engine}/health"),
        ]);
        v.extend([
            "--check-interval-ms".into(),
            "50".into(),
            "--drain-seconds".into(),
            "0".into(),
        ]);
        v.extend(extra.iter().map(|s| s.to_string()));
        Cli::parse_from(v).a
    };
    let err = kvepp::agent::run(args(&[]), l, std::future::pending())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("no label kvepp.io/component"),
        "{err}"
    );

    std::fs::write(&labels, "app=\"vllm\"\nkvepp.io/component=\"pool\"\n").unwrap();
    let md_file = dir.path().join("metadata.yaml");
    std::fs::write(&md_file, "role: prefill\nmodel: {type: Completions}\n").unwrap();
    let l = tokio::net::TcpListener::bind(agent_addr).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(kvepp::agent::run(
        args(&[
            "--model-name",
            "m",
            "--block-size",
            "16",
            "--kv-events-port",
            "5557",
            "--topology",
            "zone=z9",
            "--metadata-file",
            md_file.to_str().unwrap(),
        ]),
        l,
        async {
            let _ = stopped.await;
        },
    ));

    // The endpoints controller: the slice lists the pod with the agent's probe result.
    api.put(POOLS_V1, pool_v1("pool", 8000));
    api.put(MODELS, model("m", "m", "pool", &[]));
    let controller = {
        let api = api.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let ready = http(agent_addr, "GET", "/health", &[], "").await.status == 200;
                if last != Some(ready) {
                    api.put(
                        SLICES,
                        slice(
                            "pool-w",
                            "pool",
                            backend.port(),
                            Some(agent_addr.port()),
                            &[("127.0.0.1", "pod-w", ready)],
                        ),
                    );
                    last = Some(ready);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let kubeconfig = api.kubeconfig(dir.path());
    let epp = Epp::start("", |c| {
        c.manifests_dir = None;
        c.kubeconfig = Some(kubeconfig);
        c.engine_metrics.enabled = false;
    })
    .await;
    let endpoint = "kvepp_ready_endpoints";
    wait_for("the agent's pod is routable", || async {
        (epp.metric(endpoint).await == Some(1.0)).then_some(())
    })
    .await;
    // /metadata is the selector's schema, and the EPP fetched it through the metadata port.
    let md = http(agent_addr, "GET", "/metadata", &[], "").await.json();
    assert_eq!(md["model"]["name"], "m");
    assert_eq!(md["model"]["runtime_config"]["block_size"], 16);
    assert_eq!(md["kv_events"]["endpoints"]["0"], "tcp://127.0.0.1:5557");
    assert_eq!(md["topology_domains"]["zone"], "z9");
    assert_eq!(
        (md["role"].as_str(), md["model"]["type"].as_str()),
        (Some("prefill"), Some("Completions")),
        "the file, under the flags"
    );
    // The file is re-read when it changes (atomically replaced, as a ConfigMap volume does).
    std::fs::write(
        dir.path().join(".md.tmp"),
        "role: decode\ntopology_domains: {rack: r1}\n",
    )
    .unwrap();
    std::fs::rename(dir.path().join(".md.tmp"), &md_file).unwrap();
    let md = wait_for("metadata updated live", || async {
        let md = http(agent_addr, "GET", "/metadata", &[], "").await.json();
        (md["role"] == "decode").then_some(md)
    })
    .await;
    assert_eq!(
        (
            md["topology_domains"]["rack"].as_str(),
            md["topology_domains"]["zone"].as_str()
        ),
        (Some("r1"), Some("z9"))
    );
    assert_eq!(md["model"]["name"], "m", "flags still apply");
    let series = format!(
        "kvepp_endpoint_metadata_missing{{endpoint=\"127.0.0.1:{}\"}}",
        backend.port()
    );
    wait_for("metadata fetched", || async {
        (epp.metric(&series).await == Some(0.0)).then_some(())
    })
    .await;

    // The engine's health fails → the probe fails → the slice says unready → not routed.
    healthy.store(false, Ordering::SeqCst);
    wait_for("pod out of the pool", || async {
        (epp.metric(endpoint).await == Some(0.0)).then_some(())
    })
    .await;
    assert_eq!(
        http(agent_addr, "GET", "/health", &[], "").await.status,
        503
    );
    healthy.store(true, Ordering::SeqCst);
    wait_for("pod back", || async {
        (epp.metric(endpoint).await == Some(1.0)).then_some(())
    })
    .await;

    // Shutdown drains: unready at once.
    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    controller.abort();
    epp.stop().await;
}

/// The topology design's admission table, through the real `kube` client: with `cluster_topology`
/// and a `kv_transfer_topology_level`, kvepp refuses to start when Grove is not installed, the
/// ClusterTopology does not exist, or it lacks the level; it starts when the level is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_transfer_level_is_checked_against_the_cluster_topology() {
    let api = FakeApi::start().await;
    api.put(POOLS_V1, pool_v1("pool", 8000));
    let dir = TempDir::new("kube-topology");
    let kubeconfig = api.kubeconfig(dir.path());
    let config = |level: &str| {
        kube_config(kubeconfig.clone(), |c| {
            c.cluster_topology = Some("my-cluster-topology".into());
            c.disaggregation.kv_transfer_topology_level = Some(level.into());
        })
    };
    // A refused start returns its error by itself; an accepted one becomes ready and serves
    // until stopped.
    let refusal = |level: &'static str| {
        let cfg = config(level);
        async move {
            let listeners = kvepp::server::Listeners::bind(&cfg).await.unwrap();
            let run = kvepp::server::run(cfg, listeners, std::future::pending());
            let result = tokio::time::timeout(DEADLINE, run)
                .await
                .expect("a refused start returns");
            result.expect_err("refused").to_string()
        }
    };
    // Grove not installed: the ClusterTopology API answers 404.
    api.set_missing(CLUSTER_TOPOLOGIES, true);
    let err = refusal("zone").await;
    assert!(err.contains("Grove is not installed"), "{err}");
    // Installed, but no such ClusterTopology.
    api.set_missing(CLUSTER_TOPOLOGIES, false);
    let err = refusal("zone").await;
    assert!(err.contains("no such ClusterTopology"), "{err}");
    // The level is not one of its levels.
    api.put(
        CLUSTER_TOPOLOGIES,
        serde_json::json!({"metadata": {"name": "my-cluster-topology"}, "spec": {"levels": [
            {"domain": "zone", "labelKey": "topology.kubernetes.io/zone"},
            {"domain": "rack", "labelKey": "nvidia.com/rack"}]}}),
    );
    let err = refusal("block").await;
    assert!(
        err.contains("\"block\" is not a level") && err.contains("zone, rack"),
        "{err}"
    );
    // A level it has: kvepp starts and becomes ready.
    let cfg = config("rack");
    let listeners = kvepp::server::Listeners::bind(&cfg).await.unwrap();
    let [_, _, metrics] = listeners.addrs().map(Option::unwrap);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvepp::server::run(cfg, listeners, async {
        let _ = stopped.await;
    }));
    wait_for("kvepp ready with the level accepted", || async {
        (http(metrics, "GET", "/ready", &[], "").await.status == 200).then_some(())
    })
    .await;
    let _ = stop.send(());
    let ended = tokio::time::timeout(DEADLINE, task).await.expect("stops");
    assert!(ended.expect("task").is_ok());
}

/// kvepp on ephemeral loopback ports, discovering pool `pool` through `kubeconfig`, engine
/// metrics off, with `tweak` applied; validated.
fn kube_config(
    kubeconfig: std::path::PathBuf,
    tweak: impl FnOnce(&mut kvepp::config::Config),
) -> kvepp::config::Config {
    let mut cfg = kvepp::config::Config {
        bind_address: std::net::Ipv4Addr::LOCALHOST.into(),
        grpc_port: 0,
        grpc_health_port: 0,
        metrics_port: 0,
        pool_name: "pool".into(),
        kubeconfig: Some(kubeconfig),
        shutdown_grace_seconds: 1,
        ..Default::default()
    };
    cfg.engine_metrics.enabled = false;
    tweak(&mut cfg);
    cfg.validate().unwrap();
    cfg
}
