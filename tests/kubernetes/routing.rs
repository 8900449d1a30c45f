//! kvepp routing real requests through Envoy from what the API server says: pods, every CRD's
//! changes, an API server outage, the worker agent's readiness, the Grove topology check.

use super::*;

/// Waits until a request for `model` through Envoy is answered `code`.
async fn until_answered(envoy: &Envoy, what: &str, model: &str, code: u16) {
    wait_for(what, || async {
        let (_, codes, _) = served_by(envoy, model, 1).await;
        (codes == [code]).then_some(())
    })
    .await;
}

/// kvepp in front of Envoy, discovering everything from the API server: only the ready pods are
/// routed to; pods, InferenceModels, InferenceObjectives and InferenceModelRewrites (both groups)
/// added, changed and deleted change the routing, and so does the InferencePool's deletion; a
/// missing CRD is an empty kind; while the API server is down kvepp routes on what it last saw,
/// and follows again once it is back.
#[test]
fn kubeconfig_epp_routes_to_exactly_the_ready_pods_and_follows_models() {
    in_pod_network!(
        kubeconfig_epp_routes_to_exactly_the_ready_pods_and_follows_models,
        epp_follows_the_cluster
    );
}

async fn epp_follows_the_cluster() {
    let mut cluster = KubeCluster::start().await;
    let pods = Pods::start(&["pod-a", "pod-b", "pod-c"]).await;
    // Only the v1 InferencePool CRD is installed.
    cluster
        .delete(CRDS, "inferencepools.inference.networking.x-k8s.io")
        .await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    cluster
        .put(MODELS, model("chat", "chat", "pool", &[]))
        .await;
    cluster
        .put(MODELS, model("foreign", "foreign", "other-pool", &[]))
        .await;
    pods.put(&cluster, &[true, true, false]).await;
    let dir = TempDir::new("kube-epp");
    let kubeconfig = cluster.kubeconfig(dir.path());
    let epp = Epp::start("", |c| {
        c.manifests_dir = None;
        c.kubeconfig = Some(kubeconfig);
        c.engine_metrics.enabled = false;
        c.endpoint_picker_service = Some("kvepp".into());
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;

    let (seen, codes, _) = served_by(&envoy, "chat", 16).await;
    assert!(codes.iter().all(|c| *c == 200), "{codes:?}");
    assert_eq!(seen, set(&["pod-a", "pod-b"]), "only the ready pods");
    let (_, codes, _) = served_by(&envoy, "foreign", 1).await;
    assert_eq!(codes, [404], "models of other pools are ignored");
    // The gateway's controller reports the pool's status; that is no change of the pool.
    let accepted = json!({"parents": [{"parentRef": {"name": "inference-gateway", "kind": "Gateway"},
        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]});
    cluster.patch_status(POOLS_V1, "pool", accepted).await;
    let (seen, _, _) = served_by(&envoy, "chat", 8).await;
    assert_eq!(
        seen,
        set(&["pod-a", "pod-b"]),
        "a status update changes nothing"
    );

    // Pods come and go.
    pods.put(&cluster, &[false, true, true]).await;
    wait_for("pod-a out, pod-c in", || async {
        let (seen, _, _) = served_by(&envoy, "chat", 8).await;
        (seen == set(&["pod-b", "pod-c"])).then_some(())
    })
    .await;
    cluster.delete(SLICES, "pool-pod-b").await;
    wait_for("pod-b's slice deleted", || async {
        let (seen, _, _) = served_by(&envoy, "chat", 8).await;
        (seen == set(&["pod-c"])).then_some(())
    })
    .await;

    // InferenceModel added, changed, deleted.
    cluster
        .put(
            MODELS,
            model("review", "review", "pool", &[("review-v1", 1)]),
        )
        .await;
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
    cluster
        .put(
            MODELS,
            model("review", "review", "pool", &[("review-v2", 1)]),
        )
        .await;
    wait_for("model changed", || async {
        let (_, _, models) = served_by(&envoy, "review", 1).await;
        (models == [Some("review-v2".to_owned())]).then_some(())
    })
    .await;
    cluster.delete(MODELS, "review").await;
    until_answered(&envoy, "model deleted → 404", "review", 404).await;

    // InferenceObjective added, moved to another pool, back, deleted.
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
            .status
        }
    };
    assert_eq!(
        with_objective("gold").await,
        404,
        "an objective the pool lacks"
    );
    cluster.put(OBJECTIVES, objective("gold", 5, "pool")).await;
    wait_for("objective added", || async {
        (with_objective("gold").await == 200).then_some(())
    })
    .await;
    cluster
        .put(OBJECTIVES, objective("gold", 5, "other-pool"))
        .await;
    wait_for("objective moved to another pool → 404", || async {
        (with_objective("gold").await == 404).then_some(())
    })
    .await;
    cluster.put(OBJECTIVES, objective("gold", -1, "pool")).await;
    wait_for("objective back", || async {
        (with_objective("gold").await == 200).then_some(())
    })
    .await;
    cluster.delete(OBJECTIVES, "gold").await;
    wait_for("objective deleted → 404", || async {
        (with_objective("gold").await == 404).then_some(())
    })
    .await;

    // InferenceModelRewrite under both groups; an invalid one (weights summing to 0, which the
    // CRD's schema admits) is ignored and counted.
    cluster
        .put(
            REWRITES_LLMD,
            rewrite("alias", "pool", Some("assistant"), "chat"),
        )
        .await;
    let models = wait_for("llm-d.ai rewrite added", || async {
        let (_, codes, models) = served_by(&envoy, "assistant", 1).await;
        (codes == [200]).then_some(models)
    })
    .await;
    assert_eq!(models, [Some("chat".to_owned())]);
    cluster
        .put(
            REWRITES_X,
            rewrite("fallback", "pool", None, "chat-fallback"),
        )
        .await;
    wait_for("inference.networking.x-k8s.io catch-all added", || async {
        let (_, codes, models) = served_by(&envoy, "foreign", 1).await;
        (codes == [200] && models == [Some("chat-fallback".to_owned())]).then_some(())
    })
    .await;
    let invalid = epp.metric("kvepp_catalog_invalid_objects_total").await;
    let mut zero = rewrite("zero", "pool", Some("z"), "z-v1");
    zero["spec"]["rules"][0]["targets"][0]["weight"] = 0.into();
    cluster.put(REWRITES_LLMD, zero).await;
    wait_for("the zero-weight rewrite counted as invalid", || async {
        (epp.metric("kvepp_catalog_invalid_objects_total").await > invalid).then_some(())
    })
    .await;
    let (_, _, models) = served_by(&envoy, "z", 1).await;
    assert_eq!(
        models,
        [Some("chat-fallback".to_owned())],
        "the catch-all takes z"
    );
    cluster.delete(REWRITES_X, "fallback").await;
    cluster.delete(REWRITES_LLMD, "alias").await;
    until_answered(&envoy, "rewrites deleted → 404", "assistant", 404).await;

    // The InferencePool deleted: 503 `pool_not_found`; created again: routed again.
    cluster.delete(POOLS_V1, "pool").await;
    until_answered(&envoy, "pool deleted → 503", "chat", 503).await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    wait_for("pool back", || async {
        let (seen, codes, _) = served_by(&envoy, "chat", 4).await;
        (codes == [200; 4] && seen == set(&["pod-c"])).then_some(())
    })
    .await;

    // The API server goes away: kvepp keeps routing on its last view, and follows the cluster
    // again once the API server is back.
    cluster.stop_apiserver();
    let (seen, codes, _) = served_by(&envoy, "chat", 8).await;
    assert_eq!(
        (seen, codes),
        (set(&["pod-c"]), vec![200; 8]),
        "served during the outage"
    );
    cluster.start_apiserver().await;
    pods.put(&cluster, &[true, false, true]).await;
    kvepp_test_support::wait_until(
        "after the restart: pod-a and pod-c",
        BACKOFF_DEADLINE,
        || async {
            let (seen, _, _) = served_by(&envoy, "chat", 8).await;
            (seen == set(&["pod-a", "pod-c"])).then_some(())
        },
    )
    .await
    .unwrap();
    assert_eq!(epp.metric("kvepp_ready_endpoints").await, Some(2.0));
    epp.stop().await;
}

/// Slices that cannot be listed at all (an API server without `discovery.k8s.io`, which a real
/// one always serves, so the wire-level fake plays it): the pool is known but its endpoints are
/// not synced, so kvepp is not ready; it becomes ready after the first full sync.
#[tokio::test]
async fn readiness_waits_for_the_first_sync() {
    let api = FakeApi::start().await;
    let dir = TempDir::new("kube-ready");
    api.put(POOLS_V1ALPHA2, json!({"metadata": {"name": "pool"}, "spec": {"targetPortNumber": 8000, "selector": {"app": "x"}}}));
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
async fn engine_health(at: SocketAddr, healthy: Arc<AtomicBool>) {
    let l = tokio::net::TcpListener::bind(at).await.unwrap();
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
}

/// The worker agent in a pod: the test plays the kubelet (probing the agent's /health and
/// reporting the Pod's Ready condition to the API server) and the endpoints controller (the
/// pod's slice from the Pod's status in the API server). kvepp fetches /metadata from the
/// agent at the pod's address; the engine's health takes the pod in and out of the pool.
#[test]
fn worker_agent_readiness_flips_the_pod_and_its_slice() {
    in_pod_network!(
        worker_agent_readiness_flips_the_pod_and_its_slice,
        agent_readiness
    );
}

async fn agent_readiness() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: kvepp::agent::AgentArgs,
    }
    let cluster = Arc::new(KubeCluster::start().await);
    let dir = TempDir::new("agent");
    let pod = pod_ip(0);
    let healthy = Arc::new(AtomicBool::new(true));
    // vLLM's health on the pod's loopback-only port; the echo backend on its serving port.
    let engine: SocketAddr = (pod, 8001).into();
    engine_health(engine, healthy.clone()).await;
    let l = tokio::net::TcpListener::bind((pod, 8000)).await.unwrap();
    tokio::spawn(kvepp_test_support::serve_echo_backend(l, "pod-w".into()));
    let agent_addr: SocketAddr = (pod, 8090).into();

    let labels = dir.path().join("labels");
    std::fs::write(&labels, "app=\"vllm\"\nkvepp.io/component=\"pool\"\n").unwrap();
    let md_file = dir.path().join("metadata.yaml");
    std::fs::write(&md_file, "role: prefill\nmodel: {type: Completions}\n").unwrap();
    let args: Vec<String> = [
        "x",
        "--component",
        "pool",
        "--namespace",
        "default",
        "--pod-name",
        "pod-w",
        "--check-interval-ms",
        "50",
        "--drain-seconds",
        "0",
        "--model-name",
        "m",
        "--block-size",
        "16",
        "--kv-events-port",
        "5557",
    ]
    .map(String::from)
    .into_iter()
    .chain([
        "--labels-file".into(),
        labels.display().to_string(),
        "--engine-health-url".into(),
        format!("http://{engine}/health"),
        "--metadata-file".into(),
        md_file.display().to_string(),
    ])
    .collect();
    let l = tokio::net::TcpListener::bind(agent_addr).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(kvepp::agent::run(Cli::parse_from(args).a, l, async {
        let _ = stopped.await;
    }));

    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    cluster.put(MODELS, model("m", "m", "pool", &[])).await;
    cluster.put(PODS, super::pod("pod-w")).await;
    // The kubelet and the endpoints controller, each doing its own part through the API server.
    let control = {
        let cluster = cluster.clone();
        tokio::spawn(async move {
            let admin = cluster.admin();
            let pods: kube::Api<k8s_openapi::api::core::v1::Pod> =
                kube::Api::namespaced(admin, "default");
            let mut last = None;
            loop {
                let ready = http(agent_addr, "GET", "/health", &[], "").await.status == 200;
                if last != Some(ready) {
                    cluster
                        .patch_status(PODS, "pod-w", pod_status(pod, ready))
                        .await;
                    let p = pods.get("pod-w").await.unwrap();
                    let st = p.status.unwrap_or_default();
                    let ready_now = st
                        .conditions
                        .unwrap_or_default()
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True");
                    let ip = st.pod_ip.unwrap_or_default();
                    cluster
                        .put(
                            SLICES,
                            slice(
                                "pool-w",
                                "pool",
                                8000,
                                Some(8090),
                                &[(&ip, "pod-w", ready_now)],
                            ),
                        )
                        .await;
                    last = Some(ready);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let kubeconfig = cluster.kubeconfig(dir.path());
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
    // kvepp fetched /metadata from the agent at the pod's address.
    let series = format!("kvepp_endpoint_metadata_missing{{endpoint=\"{pod}:8000\"}}");
    wait_for("metadata fetched", || async {
        (epp.metric(&series).await == Some(0.0)).then_some(())
    })
    .await;
    let md = http(agent_addr, "GET", "/metadata", &[], "").await.json();
    assert_eq!(
        (md["model"]["name"].as_str(), md["role"].as_str()),
        (Some("m"), Some("prefill"))
    );

    // The engine fails its health check → the probe fails → the Pod is not Ready → the slice
    // says unready → not routed; and back.
    healthy.store(false, Ordering::SeqCst);
    wait_for("pod out of the pool", || async {
        (epp.metric(endpoint).await == Some(0.0)).then_some(())
    })
    .await;
    let p: Value = serde_json::to_value(
        kube::Api::<k8s_openapi::api::core::v1::Pod>::namespaced(cluster.admin(), "default")
            .get("pod-w")
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        p["status"]["conditions"][0]["status"], "False",
        "the Pod reports it"
    );
    healthy.store(true, Ordering::SeqCst);
    wait_for("pod back", || async {
        (epp.metric(endpoint).await == Some(1.0)).then_some(())
    })
    .await;

    let _ = stop.send(());
    agent.await.unwrap().unwrap();
    control.abort();
    epp.stop().await;
}

/// Grove's ClusterTopology CRD as Grove installs it (the fields kvepp reads).
const GROVE_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: clustertopologies.grove.io
spec:
  group: grove.io
  scope: Cluster
  names: {plural: clustertopologies, singular: clustertopology, kind: ClusterTopology}
  versions:
  - name: v1alpha1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              levels:
                type: array
                items:
                  type: object
                  properties:
                    domain: {type: string}
                    labelKey: {type: string}
"#;

const TOPOLOGIES: &str = "/apis/grove.io/v1alpha1/clustertopologies";

/// The topology design's admission table against a real API server: with `cluster_topology` and a
/// `kv_transfer_topology_level`, kvepp refuses to start when Grove is not installed (no CRD: 404),
/// the ClusterTopology does not exist, or it lacks the level; it starts when the level is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_transfer_level_is_checked_against_the_cluster_topology() {
    let cluster = KubeCluster::start().await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    let dir = TempDir::new("kube-topology");
    let kubeconfig = cluster.kubeconfig(dir.path());
    let config = |level: &str| {
        kube_config(kubeconfig.clone(), |c| {
            c.cluster_topology = Some("my-cluster-topology".into());
            c.disaggregation.kv_transfer_topology_level = Some(level.into());
        })
    };
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
    let err = refusal("zone").await;
    assert!(err.contains("Grove is not installed"), "{err}");
    cluster.apply_yaml(GROVE_CRD).await;
    cluster.wait_established("clustertopologies.grove.io").await;
    let err = refusal("zone").await;
    assert!(err.contains("no such ClusterTopology"), "{err}");
    cluster
        .put(
            TOPOLOGIES,
            json!({"metadata": {"name": "my-cluster-topology"}, "spec": {"levels": [
                {"domain": "zone", "labelKey": "topology.kubernetes.io/zone"},
                {"domain": "rack", "labelKey": "nvidia.com/rack"}]}}),
        )
        .await;
    let err = refusal("block").await;
    assert!(
        err.contains("\"block\" is not a level") && err.contains("zone, rack"),
        "{err}"
    );
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
