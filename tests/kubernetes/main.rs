//! kvepp's Kubernetes code against a real API server (`kvepp_test_support::kube_cluster`: etcd and
//! kube-apiserver built from the Go module proxy, TLS, token authentication, RBAC, kvepp's CRDs):
//! the EndpointSlice watch across readiness flips, an API server restart, a real 410 Gone after an
//! etcd compaction, bookmarks; every CRD change routing real requests through Envoy; the worker
//! agent's readiness reaching the Pod and its slice; RBAC that grants kvepp exactly what it uses
//! and refuses the rest; tokens the API server refuses; a pool of 1,000 endpoints; the Grove
//! ClusterTopology check; the shipped manifests and Helm chart accepted by the server (dry run);
//! the Gateway API Inference Extension's reference EPP routing from the same API server.
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

/// Runs a test's body in a pod network of its own (`pod_network::run`), naming the test as
/// libtest lists it (its path in this crate).
macro_rules! in_pod_network {
    ($test:ident, $body:expr) => {
        pod_network::run(&test_path(module_path!(), stringify!($test)), $body)
    };
}

mod access;
mod peers;
mod routing;
mod watch;

/// `module::test` from `module_path!()` (which starts with the crate's name) and the test's name.
fn test_path(module: &str, test: &str) -> String {
    match module.split_once("::") {
        Some((_, m)) => format!("{m}::{test}"),
        None => test.to_owned(),
    }
}

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

/// A model-server Pod of pool `pool` (selected by `kvepp.io/component`), before the kubelet
/// reports its status.
fn pod(name: &str) -> Value {
    json!({"metadata": {"name": name, "labels": {"kvepp.io/component": "pool"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}})
}

/// The Pod's address and Ready condition as the kubelet reports them.
fn pod_status(ip: IpAddr, ready: bool) -> Value {
    let status = if ready { "True" } else { "False" };
    json!({"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}],
        "conditions": [{"type": "Ready", "status": status}]})
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
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
