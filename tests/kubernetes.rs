//! kvepp's Kubernetes code against a real API server (`kvepp_test_support::kube_cluster`: etcd and
//! kube-apiserver built from the Go module proxy, TLS, token authentication, RBAC, kvepp's CRDs):
//! the EndpointSlice watch across readiness flips, an API server restart, a real 410 Gone after an
//! etcd compaction, bookmarks; every CRD change routing real requests through Envoy; the worker
//! agent's readiness reaching the Pod and its slice; RBAC that grants kvepp exactly what it uses
//! and refuses the rest; tokens the API server refuses; a pool of 1,000 endpoints; the Grove
//! ClusterTopology check; the shipped manifests and Helm chart accepted by the server (dry run).
//!
//! No controller or kubelet runs: the tests write Pods, their status and the EndpointSlices the
//! endpoints controller would. A real API server refuses loopback addresses in EndpointSlices, so
//! the tests that reach pods run in a network namespace of their own where the pod network
//! (10.244.0.0/16) is local (`kvepp_test_support::pod_network`). The wire-level fake API server
//! remains for the one case a real one cannot be made to show: an API server that does not serve
//! EndpointSlices at all.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvepp::discovery::kubernetes::{client, KubeDiscovery, WatchMetrics};
use kvepp::discovery::{InstanceEvent, InstanceStream, ServiceDiscovery};
use kvepp::metrics::ResourceLabels;
use kvepp_test_support::kube_api::{
    model, objective, pool_v1, rewrite, slice, FakeApi, MODELS, OBJECTIVES, POOLS_V1,
    POOLS_V1ALPHA2, REWRITES_LLMD, REWRITES_X, SLICES,
};
use kvepp_test_support::kube_cluster::{
    self, documents, status_of, KubeCluster, Options, CRDS, PODS,
};
use kvepp_test_support::pod_network::{self, pod_ip};
use kvepp_test_support::prelude::*;
use kvepp_test_support::TempDir;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_kvepp");
/// Deadline for what waits on kube-rs's backoff after a refusal or an outage (it grows to 30 s).
const BACKOFF_DEADLINE: Duration = Duration::from_secs(90);
/// The stated time for a pool of 1,000 endpoints to be discovered from a fresh start.
const LARGE_POOL_DEADLINE: Duration = Duration::from_secs(30);

async fn next(w: &mut InstanceStream) -> InstanceEvent {
    tokio::time::timeout(BACKOFF_DEADLINE, w.next())
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

/// Pod `n`'s address as text.
fn ip(n: usize) -> String {
    pod_ip(n).to_string()
}

/// A slice of Service `pool` (ports http 8000, metadata 8090) listing (pod number, ready).
fn pool_slice(name: &str, eps: &[(usize, bool)]) -> Value {
    let eps: Vec<(String, String, bool)> = eps
        .iter()
        .map(|(n, r)| (ip(*n), format!("pod-{n}"), *r))
        .collect();
    let eps: Vec<(&str, &str, bool)> = eps.iter().map(|(a, p, r)| (&**a, &**p, *r)).collect();
    slice(name, "pool", 8000, Some(8090), &eps)
}

/// EndpointSlice discovery through the cluster's admin kubeconfig, and its watch metrics.
async fn discovery(cluster: &KubeCluster, dir: &Path) -> (KubeDiscovery, WatchMetrics) {
    let metrics = WatchMetrics::default();
    let kube = client(Some(&cluster.kubeconfig(dir))).await.unwrap();
    (KubeDiscovery::new(kube, metrics.clone()), metrics)
}

/// The instances a fresh list of Service `pool`'s slices gives.
async fn listed(disc: &KubeDiscovery) -> BTreeSet<String> {
    disc.list_instances("default", "pool")
        .await
        .unwrap()
        .iter()
        .map(|i| i.id.to_string())
        .collect()
}

fn relists(metrics: &WatchMetrics) -> u64 {
    metrics
        .relists
        .get_or_create(&ResourceLabels {
            resource: "endpointslices",
        })
        .get()
}

/// The watch's list, readiness flips, a pod in two slices, terminating endpoints; the API server
/// killed and restarted under the watch (changes after it arrive once, no relist); then history
/// compacted in etcd while kvepp's resourceVersion is behind it: the API server (watch cache off,
/// so etcd answers) says 410 Gone, kvepp relists and only the real differences come out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpointslice_watch_follows_readiness_restarts_and_410() {
    let mut cluster = KubeCluster::start_with(Options { watch_cache: false }).await;
    let dir = TempDir::new("kube");
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true), (2, false)]))
        .await;
    cluster
        .put(
            SLICES,
            slice("other-x", "other", 8000, None, &[(&ip(9), "pod-9", true)]),
        )
        .await;
    let (disc, metrics) = discovery(&cluster, dir.path()).await;

    // Initial list: the ready pod of this Service only, then Synced.
    let mut w = disc.watch("default", "pool");
    let first = next(&mut w).await;
    let InstanceEvent::Added(p1) = &first else {
        panic!("{first:?}")
    };
    assert_eq!(
        (&*p1.id, p1.ip, p1.port, p1.metadata_port),
        ("pod-1", pod_ip(1), Some(8000), Some(8090))
    );
    assert_eq!(
        (p1.zone.as_deref(), p1.node.as_deref()),
        (Some("zone-a"), Some("node-1"))
    );
    assert_eq!(next(&mut w).await, InstanceEvent::Synced);
    assert_eq!(listed(&disc).await, set(&["pod-1"]));

    // Readiness flips are Added / Removed.
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true), (2, true)]))
        .await;
    assert_eq!(added(&next(&mut w).await), Some("pod-2"));
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, false), (2, true)]))
        .await;
    assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-1".into()));

    // A pod in two slices is one instance.
    cluster
        .put(SLICES, pool_slice("pool-b", &[(2, true), (3, true)]))
        .await;
    assert_eq!(added(&next(&mut w).await), Some("pod-3"));
    cluster.delete(SLICES, "pool-a").await;
    cluster
        .put(SLICES, pool_slice("pool-c", &[(4, true)]))
        .await;
    assert!(
        until_added(&mut w, "pod-4").await.is_empty(),
        "slice deletion kept pod-2 (still in pool-b)"
    );
    // Terminating endpoints take no new work.
    let mut term = pool_slice("pool-c", &[(4, true)]);
    term["endpoints"][0]["conditions"]["terminating"] = true.into();
    cluster.put(SLICES, term).await;
    assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-4".into()));

    // The API server dies under the watch and comes back: the watch resumes from its
    // resourceVersion (etcd still has it) and changes made after arrive once, without a relist.
    let lists = relists(&metrics);
    cluster.restart_apiserver().await;
    cluster
        .put(SLICES, pool_slice("pool-c", &[(4, true), (5, true)]))
        .await;
    let before = until_added(&mut w, "pod-5").await;
    assert_eq!(
        ids(&before),
        ["+pod-4"],
        "pod-4 is ready again; nothing else changed"
    );
    assert_eq!(
        relists(&metrics),
        lists,
        "a resumable watch does not relist"
    );

    // Other objects move etcd's revision past kvepp's, history is compacted, and the API server
    // restarts: kvepp's resourceVersion is gone (410 Gone), it relists, and the state it reports
    // after is exactly the cluster's: pod-3 removed once, pod-6 added, nothing duplicated.
    for i in 0..5 {
        cluster
            .put(
                SLICES,
                slice(
                    "other-x",
                    "other",
                    8000 + i,
                    None,
                    &[(&ip(9), "pod-9", true)],
                ),
            )
            .await;
    }
    let compacted = cluster.compact().await;
    cluster.restart_apiserver().await;
    cluster
        .put(
            SLICES,
            pool_slice("pool-b", &[(2, true), (3, false), (6, true)]),
        )
        .await;
    let before = until_added(&mut w, "pod-6").await;
    assert_eq!(ids(&before), ["-pod-3"]);
    assert!(
        relists(&metrics) > lists,
        "the 410 after compaction at revision {compacted} forced a relist"
    );
    let now = listed(&disc).await;
    assert_eq!(
        now,
        ["pod-2", "pod-4", "pod-5", "pod-6"]
            .map(String::from)
            .into()
    );
}

/// The API server's count of watch events sent on EndpointSlice watches.
async fn slice_watch_events(cluster: &KubeCluster) -> f64 {
    let text = cluster.metrics_text().await;
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_watch_events_total{")
                && l.contains("group=\"discovery.k8s.io\"")
                && l.contains("resource=\"endpointslices\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Bookmarks, with the API server's watch cache on (as in every cluster): kvepp's watch asks for
/// them, the API server sends one about a minute into a quiet watch (seen in its own count of
/// events sent on EndpointSlice watches while no pool slice changed), and kvepp absorbs it: no
/// event, no relist, and the next change arrives as usual. After a restart of the API server
/// (whose new watch cache starts at etcd's current revision: kvepp resumes, or relists when that
/// is past its resourceVersion) what kvepp reports is the cluster's state with nothing duplicated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookmarks_are_absorbed_and_a_restart_relists_cleanly() {
    let mut cluster = KubeCluster::start().await;
    let dir = TempDir::new("kube-bookmarks");
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true)]))
        .await;
    let (disc, metrics) = discovery(&cluster, dir.path()).await;
    let mut w = disc.watch("default", "pool");
    assert_eq!(added(&next(&mut w).await), Some("pod-1"));
    assert_eq!(next(&mut w).await, InstanceEvent::Synced);
    for port in 8000..8005 {
        let other = slice("other-x", "other", port, None, &[(&ip(9), "pod-9", true)]);
        cluster.put(SLICES, other).await;
    }
    let sent = slice_watch_events(&cluster).await;
    let lists = relists(&metrics);
    let t = Instant::now();
    kvepp_test_support::wait_until(
        "a bookmark on kvepp's EndpointSlice watch",
        Duration::from_secs(120),
        || async { (slice_watch_events(&cluster).await > sent).then_some(()) },
    )
    .await
    .unwrap();
    eprintln!("bookmark after {:?}", t.elapsed());
    assert_eq!(
        futures::FutureExt::now_or_never(w.next()),
        None,
        "a bookmark is no event"
    );
    cluster
        .put(SLICES, pool_slice("pool-a", &[(1, true), (2, true)]))
        .await;
    assert_eq!(added(&next(&mut w).await), Some("pod-2"));
    assert_eq!(relists(&metrics), lists, "a bookmark is no relist");

    cluster.restart_apiserver().await;
    cluster
        .put(
            SLICES,
            pool_slice("pool-a", &[(1, true), (2, true), (3, true)]),
        )
        .await;
    assert!(
        until_added(&mut w, "pod-3").await.is_empty(),
        "nothing duplicated"
    );
    let now = listed(&disc).await;
    assert_eq!(now, set(&["pod-1", "pod-2", "pod-3"]));
}

/// Echo backends standing in for model servers, each on its own pod address at port 8000, and
/// one slice per pod as the endpoints controller writes them.
struct Pods {
    names: Vec<String>,
}

impl Pods {
    async fn start(names: &[&str]) -> Pods {
        for (n, name) in names.iter().enumerate() {
            let l = tokio::net::TcpListener::bind((pod_ip(n), 8000))
                .await
                .expect("bind a pod address: pods live in the pod network of the local API server");
            tokio::spawn(kvepp_test_support::serve_echo_backend(l, name.to_string()));
        }
        Pods {
            names: names.iter().map(|s| s.to_string()).collect(),
        }
    }

    async fn put(&self, cluster: &KubeCluster, ready: &[bool]) {
        for (n, (name, r)) in self.names.iter().zip(ready).enumerate() {
            cluster
                .put(
                    SLICES,
                    slice(
                        &format!("pool-{name}"),
                        "pool",
                        8000,
                        None,
                        &[(&ip(n), name, *r)],
                    ),
                )
                .await;
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

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

/// kvepp in front of Envoy, discovering everything from the API server: only the ready pods are
/// routed to; pods, InferenceModels, InferenceObjectives and InferenceModelRewrites (both groups)
/// added, changed and deleted change the routing; a missing CRD is an empty kind; while the API
/// server is down kvepp routes on what it last saw, and follows again once it is back.
#[test]
fn kubeconfig_epp_routes_to_exactly_the_ready_pods_and_follows_models() {
    pod_network::run(
        "kubeconfig_epp_routes_to_exactly_the_ready_pods_and_follows_models",
        epp_follows_the_cluster,
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
    wait_for("model deleted → 404", || async {
        let (_, codes, _) = served_by(&envoy, "review", 1).await;
        (codes == [404]).then_some(())
    })
    .await;

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
    wait_for("rewrites deleted → 404", || async {
        let (_, codes, _) = served_by(&envoy, "assistant", 1).await;
        (codes == [404]).then_some(())
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

/// The kvepp binary with its credentials where every Kubernetes tool finds them (`KUBECONFIG`,
/// no flag, no manifests directory); its log goes to a file.
struct Binary {
    child: Child,
    metrics: SocketAddr,
    grpc: SocketAddr,
    log: PathBuf,
}

impl Binary {
    fn start(kubeconfig: &Path, dir: &Path, tag: &str) -> Binary {
        let (grpc, metrics) = (free_port(), free_port());
        let log = dir.join(format!("{tag}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let config = dir.join(format!("{tag}.yaml"));
        std::fs::write(&config, "engine_metrics: {enabled: false}\n").unwrap();
        let child = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&config)
            .args(["--pool-name", "pool", "--bind-address", "127.0.0.1"])
            .args(["--grpc-port", &grpc.to_string()])
            .args(["--grpc-health-port", &free_port().to_string()])
            .args(["--metrics-port", &metrics.to_string()])
            .env("KUBECONFIG", kubeconfig)
            .env_remove("KVEPP_MANIFESTS_DIR")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Binary {
            child,
            metrics: ([127, 0, 0, 1], metrics).into(),
            grpc: ([127, 0, 0, 1], grpc).into(),
            log,
        }
    }

    async fn metric(&self, series: &str) -> Option<f64> {
        tokio::net::TcpStream::connect(self.metrics).await.ok()?;
        let r = http(self.metrics, "GET", "/metrics", &[], "").await;
        kvepp_test_support::find_sample(&String::from_utf8_lossy(&r.body), series)
    }

    async fn ready(&self) -> Option<u16> {
        tokio::net::TcpStream::connect(self.metrics).await.ok()?;
        Some(http(self.metrics, "GET", "/ready", &[], "").await.status)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the API server's refusal shows: the gauge, /ready 503, and the log line.
    async fn wait_refused(&self, why: &str) {
        let refused = "kvepp_discovery_refused{resource=\"endpointslices\"}";
        kvepp_test_support::wait_until("kvepp reports the refusal", BACKOFF_DEADLINE, || async {
            (self.metric(refused).await == Some(1.0)).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", self.log()));
        assert_eq!(self.ready().await, Some(503), "not ready while refused");
        wait_for("the refusal's log line", || async {
            let log = self.log();
            (log.contains("the Kubernetes API server refuses kvepp") && log.contains(why))
                .then_some(())
        })
        .await;
    }
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The RBAC objects of `manifests/kubernetes/base` (ServiceAccount, Role, bindings), as YAML.
fn base_rbac(kinds: &[&str]) -> String {
    let text =
        std::fs::read_to_string(repo_root().join("manifests/kubernetes/base/kvepp.yaml")).unwrap();
    documents(&text)
        .into_iter()
        .filter(|d| kinds.contains(&d["kind"].as_str().unwrap_or_default()))
        .map(|d| serde_yaml::to_string(&d).unwrap())
        .collect::<Vec<_>>()
        .join("---\n")
}

/// kvepp with its ServiceAccount's token and exactly the RBAC of `manifests/kubernetes/base`:
/// before the Role is bound the API server refuses it (403: a clear log line, not ready, never an
/// empty pool), once bound it syncs and routes through Envoy; with the same token the API server
/// refuses everything kvepp does not use (secrets, pods, every write, `get`, other namespaces).
/// A wrong token and an expired one (signed by the cluster's own key) are refused with 401, and
/// kvepp says so.
#[test]
fn rbac_grants_kvepp_exactly_what_it_uses() {
    pod_network::run("rbac_grants_kvepp_exactly_what_it_uses", rbac_for_real);
}

async fn rbac_for_real() {
    let cluster = KubeCluster::start().await;
    let dir = TempDir::new("kube-rbac");
    let pods = Pods::start(&["pod-a"]).await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    cluster
        .put(MODELS, model("chat", "chat", "pool", &[]))
        .await;
    pods.put(&cluster, &[true]).await;

    // The ServiceAccount alone: every list is refused.
    cluster.apply_yaml(&base_rbac(&["ServiceAccount"])).await;
    let kubeconfig = cluster
        .service_account_kubeconfig(dir.path(), "default", "kvepp")
        .await;
    let kvepp = Binary::start(&kubeconfig, dir.path(), "kvepp");
    kvepp.wait_refused("RBAC").await;
    assert_eq!(kvepp.metric("kvepp_ready_endpoints").await, Some(0.0));

    // The base's Role and bindings: kvepp syncs (after its backoff) and routes.
    cluster
        .apply_yaml(&base_rbac(&[
            "Role",
            "RoleBinding",
            "ClusterRole",
            "ClusterRoleBinding",
        ]))
        .await;
    kvepp_test_support::wait_until("ready once the Role is bound", BACKOFF_DEADLINE, || async {
        (kvepp.ready().await == Some(200)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kvepp.log()));
    assert_eq!(
        kvepp
            .metric("kvepp_discovery_refused{resource=\"endpointslices\"}")
            .await,
        Some(0.0)
    );
    let envoy = Envoy::start(bootstrap(), kvepp.grpc).await;
    let (seen, codes, _) = served_by(&envoy, "chat", 4).await;
    assert_eq!((seen, codes), (set(&["pod-a"]), vec![200; 4]));

    // What the token may and may not do.
    let sa = kube_cluster::client(&kubeconfig).await;
    let allowed = [
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools",
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencepools",
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodels",
        "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodelrewrites",
        "/apis/llm-d.ai/v1alpha2/namespaces/default/inferenceobjectives",
        "/apis/llm-d.ai/v1alpha2/namespaces/default/inferencemodelrewrites",
    ];
    for path in allowed {
        assert_eq!(status_of(&sa, "GET", path, None).await, 200, "list {path}");
        let watch = format!("{path}?watch=true&timeoutSeconds=1");
        assert_eq!(
            status_of(&sa, "GET", &watch, None).await,
            200,
            "watch {path}"
        );
    }
    let slice_body = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "forged"}, "addressType": "IPv4", "endpoints": []});
    let refused: [(&str, String, Option<Value>); 9] = [
        ("GET", "/api/v1/namespaces/default/secrets".into(), None),
        (
            "GET",
            "/api/v1/namespaces/default/secrets/kvepp-api-token".into(),
            None,
        ),
        ("GET", "/api/v1/namespaces/default/pods".into(), None),
        ("GET", "/api/v1/namespaces/default/configmaps".into(), None),
        ("GET", format!("{POOLS_V1}/pool"), None),
        ("POST", SLICES.into(), Some(slice_body)),
        (
            "PATCH",
            format!("{POOLS_V1}/pool"),
            Some(json!({"metadata": {"labels": {"x": "y"}}})),
        ),
        ("DELETE", format!("{MODELS}/chat"), None),
        (
            "GET",
            "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices".into(),
            None,
        ),
    ];
    for (method, path, body) in refused {
        assert_eq!(
            status_of(&sa, method, &path, body).await,
            403,
            "{method} {path}"
        );
    }
    drop(kvepp);

    // Tokens the API server does not accept: 401, a clear log line, not ready.
    for (tag, token) in [
        ("wrong", "not-a-token".to_owned()),
        ("expired", cluster.expired_token("default", "kvepp")),
    ] {
        let kc = cluster.token_kubeconfig(dir.path(), tag, &token);
        assert_eq!(
            status_of(&kube_cluster::client(&kc).await, "GET", SLICES, None).await,
            401,
            "the {tag} token"
        );
        let kvepp = Binary::start(&kc, dir.path(), tag);
        kvepp.wait_refused("credentials").await;
    }
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

/// The Pod's Ready condition as the kubelet reports it.
fn pod_status(ip: IpAddr, ready: bool) -> Value {
    let status = if ready { "True" } else { "False" };
    json!({"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}],
        "conditions": [{"type": "Ready", "status": status}]})
}

/// The worker agent in a pod: the test plays the kubelet (probing the agent's /health and
/// reporting the Pod's Ready condition to the API server) and the endpoints controller (the
/// pod's slice from the Pod's status in the API server). kvepp fetches /metadata from the
/// agent at the pod's address; the engine's health takes the pod in and out of the pool.
#[test]
fn worker_agent_readiness_flips_the_pod_and_its_slice() {
    pod_network::run(
        "worker_agent_readiness_flips_the_pod_and_its_slice",
        agent_readiness,
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
    cluster
        .put(
            PODS,
            json!({"metadata": {"name": "pod-w", "labels": {"kvepp.io/component": "pool"}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}),
        )
        .await;
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

/// A pool of 1,000 endpoints in 10 slices (100 each, as the endpoints controller batches them),
/// discovered by a starting kvepp within the stated time.
#[test]
fn a_pool_of_a_thousand_endpoints_is_discovered() {
    pod_network::run("a_pool_of_a_thousand_endpoints_is_discovered", large_pool);
}

async fn large_pool() {
    let cluster = KubeCluster::start().await;
    cluster.put(POOLS_V1, pool_v1("pool", 8000)).await;
    for s in 0..10 {
        let eps: Vec<(String, String, bool)> = (0..100)
            .map(|i| {
                let n = s * 100 + i;
                (ip(n), format!("pod-{n}"), true)
            })
            .collect();
        let eps: Vec<(&str, &str, bool)> = eps.iter().map(|(a, p, r)| (&**a, &**p, *r)).collect();
        cluster
            .put(
                SLICES,
                slice(&format!("pool-{s}"), "pool", 8000, None, &eps),
            )
            .await;
    }
    let dir = TempDir::new("kube-large");
    let kubeconfig = cluster.kubeconfig(dir.path());
    let t = Instant::now();
    let epp = Epp::start_unready("", |c| {
        c.manifests_dir = None;
        c.kubeconfig = Some(kubeconfig);
        c.engine_metrics.enabled = false;
    })
    .await;
    kvepp_test_support::wait_until("1,000 endpoints ready", LARGE_POOL_DEADLINE, || async {
        (epp.metric("kvepp_ready_endpoints").await == Some(1000.0)).then_some(())
    })
    .await
    .unwrap();
    eprintln!(
        "1,000 endpoints in 10 slices discovered in {:?}",
        t.elapsed()
    );
    // One slice's endpoints all turn unready: exactly those leave.
    let eps: Vec<(String, String, bool)> = (0..100)
        .map(|n| (ip(n), format!("pod-{n}"), false))
        .collect();
    let eps: Vec<(&str, &str, bool)> = eps.iter().map(|(a, p, r)| (&**a, &**p, *r)).collect();
    cluster
        .put(SLICES, slice("pool-0", "pool", 8000, None, &eps))
        .await;
    wait_for("900 left", || async {
        (epp.metric("kvepp_ready_endpoints").await == Some(900.0)).then_some(())
    })
    .await;
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

/// What a platform team applies is accepted by a real API server (server-side dry run: admission,
/// validation, defaulting, the CRDs' schemas): the Kustomize overlays and the Helm chart's
/// renderings that need no third-party CRD.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipped_manifests_and_chart_pass_a_server_side_dry_run() {
    let cluster = KubeCluster::start().await;
    for overlay in ["single-replica", "active-active", "pd-pool"] {
        let text = kvepp_test_support::shipped::kustomize(&format!(
            "manifests/kubernetes/overlays/{overlay}"
        ));
        let text = String::from_utf8(text).unwrap();
        let n = cluster.apply_yaml_dry_run(&text).await;
        assert!(n >= 10, "overlay {overlay}: {n} objects");
    }
    for values in ["single-replica", "active-active", "pd-pool"] {
        let n = cluster
            .apply_yaml_dry_run(&kube_cluster::helm_template(values))
            .await;
        assert!(n >= 10, "chart with {values}: {n} objects");
    }
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
