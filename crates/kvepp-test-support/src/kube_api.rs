//! A wire-level fake Kubernetes API server (HTTP/1.1 on 127.0.0.1) that speaks the list/watch
//! protocol the real one does, for driving the real `kube::Client`:
//! - `GET /apis/<group>/<version>/namespaces/<ns>/<plural>`: a JSON list with the collection's
//!   `resourceVersion`, filtered by `labelSelector` (equality terms);
//! - the same with `watch=true&resourceVersion=N`: a chunked stream of `ADDED`/`MODIFIED`/
//!   `DELETED` events after N, a `BOOKMARK` once caught up, then live events;
//! - cluster-scoped collections (`/apis/<group>/<version>/<plural>`) list the same way;
//! - collections marked missing answer 404 (CRD not installed).
//!
//! The test drives it: put and delete objects, mark collections missing.
//!
//! kvepp's Kubernetes tests run against a real API server (`kube_cluster`, feature `kube`); this one
//! stays for what a real one cannot be made to show on demand: an API server that does not serve
//! `discovery.k8s.io` EndpointSlices at all (404 on their list). Its object builders ([`slice()`],
//! [`pool_v1`], [`model`], [`rewrite`], [`objective`]) and collection paths serve both.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::broadcast;

pub const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
pub const POOLS_V1ALPHA2: &str =
    "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencepools";
pub const POOLS_V1: &str = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools";
pub const MODELS: &str =
    "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodels";
pub const OBJECTIVES: &str = "/apis/llm-d.ai/v1alpha2/namespaces/default/inferenceobjectives";
pub const REWRITES_LLMD: &str = "/apis/llm-d.ai/v1alpha2/namespaces/default/inferencemodelrewrites";
pub const REWRITES_X: &str =
    "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/default/inferencemodelrewrites";
/// Grove's ClusterTopology (cluster-scoped).
pub const CLUSTER_TOPOLOGIES: &str = "/apis/grove.io/v1alpha1/clustertopologies";

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<String, BTreeMap<String, Value>>,
    /// (rv, collection, event type, object)
    log: Vec<(u64, String, &'static str, Value)>,
    missing: BTreeSet<String>,
}

#[derive(Clone)]
pub struct FakeApi {
    pub addr: SocketAddr,
    store: Arc<Mutex<Store>>,
    events: broadcast::Sender<(String, &'static str, Value)>,
}

/// The kind of the objects in a collection named by its plural (the collections tests use).
pub fn kind_of_plural(plural: &str) -> &'static str {
    match plural {
        "endpointslices" => "EndpointSlice",
        "inferencepools" => "InferencePool",
        "inferencemodels" => "InferenceModel",
        "inferenceobjectives" => "InferenceObjective",
        "inferencemodelrewrites" => "InferenceModelRewrite",
        "clustertopologies" => "ClusterTopology",
        "customresourcedefinitions" => "CustomResourceDefinition",
        "pods" => "Pod",
        _ => "Unknown",
    }
}

fn kind_of(collection: &str) -> (&'static str, String) {
    let plural = collection.rsplit('/').next().unwrap_or_default();
    let parts: Vec<&str> = collection.split('/').collect();
    (kind_of_plural(plural), format!("{}/{}", parts[2], parts[3]))
}

fn selector_matches(obj: &Value, selector: &[(String, String)]) -> bool {
    selector
        .iter()
        .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v))
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn line(v: &Value) -> axum::body::Bytes {
    let mut b = serde_json::to_vec(v).expect("json");
    b.push(b'\n');
    b.into()
}

impl FakeApi {
    pub async fn start() -> FakeApi {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let api = FakeApi {
            addr: listener.local_addr().expect("addr"),
            store: Arc::default(),
            events: broadcast::channel(4096).0,
        };
        let served = api.clone();
        let app = axum::Router::new().fallback(move |uri: Uri| {
            let api = served.clone();
            async move { api.handle(uri) }
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        api
    }

    /// A kubeconfig that points at this server.
    pub fn kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{}\"}}\nusers:\n- name: test\n  user: {{token: test-token}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: test, namespace: default}}\ncurrent-context: fake\n",
            self.addr
        );
        std::fs::write(&path, text).expect("write kubeconfig");
        path
    }

    /// Creates or replaces an object (by `metadata.name`) in `collection`.
    pub fn put(&self, collection: &str, mut obj: Value) {
        let (kind, api_version) = kind_of(collection);
        let mut st = self.store.lock().expect("lock");
        st.rv += 1;
        let rv = st.rv;
        let name = obj["metadata"]["name"]
            .as_str()
            .expect("metadata.name")
            .to_owned();
        obj["apiVersion"] = api_version.into();
        obj["kind"] = kind.into();
        obj["metadata"]["namespace"] = "default".into();
        obj["metadata"]["resourceVersion"] = rv.to_string().into();
        obj["metadata"]["uid"] = format!("uid-{name}").into();
        let existed = st
            .objects
            .entry(collection.to_owned())
            .or_default()
            .insert(name, obj.clone())
            .is_some();
        let ty = if existed { "MODIFIED" } else { "ADDED" };
        st.log.push((rv, collection.to_owned(), ty, obj.clone()));
        let _ = self.events.send((collection.to_owned(), ty, obj));
    }

    pub fn delete(&self, collection: &str, name: &str) {
        let mut st = self.store.lock().expect("lock");
        let Some(mut obj) = st.objects.get_mut(collection).and_then(|m| m.remove(name)) else {
            panic!("delete of a missing object {collection}/{name}");
        };
        st.rv += 1;
        let rv = st.rv;
        obj["metadata"]["resourceVersion"] = rv.to_string().into();
        st.log
            .push((rv, collection.to_owned(), "DELETED", obj.clone()));
        let _ = self.events.send((collection.to_owned(), "DELETED", obj));
    }

    /// The collection answers 404 (its CRD is not installed) until `false`.
    pub fn set_missing(&self, collection: &str, missing: bool) {
        let mut st = self.store.lock().expect("lock");
        if missing {
            st.missing.insert(collection.to_owned());
        } else {
            st.missing.remove(collection);
        }
    }

    fn handle(&self, uri: Uri) -> Response {
        let path = uri.path().to_owned();
        let query: BTreeMap<String, String> = uri
            .query()
            .unwrap_or_default()
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_owned(), percent_decode(v)))
            .collect();
        let selector: Vec<(String, String)> = query
            .get("labelSelector")
            .map(|s| {
                s.split(',')
                    .filter_map(|t| t.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let st = self.store.lock().expect("lock");
        let segments = path.split('/').count();
        if !path.starts_with("/apis/") || !(segments == 7 || segments == 5) {
            return (
                StatusCode::NOT_FOUND,
                json_body(status(404, "NotFound", "no such path")),
            )
                .into_response();
        }
        if st.missing.contains(&path) {
            return (
                StatusCode::NOT_FOUND,
                json_body(status(
                    404,
                    "NotFound",
                    "the server could not find the requested resource",
                )),
            )
                .into_response();
        }
        let (kind, api_version) = kind_of(&path);
        if matches!(query.get("watch").map(String::as_str), Some("true" | "1")) {
            let from: u64 = query
                .get("resourceVersion")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            // Replay and subscription under one lock: nothing is missed or sent twice.
            let mut live = self.events.subscribe();
            let mut backlog: Vec<axum::body::Bytes> = st
                .log
                .iter()
                .filter(|(rv, c, _, o)| *rv > from && *c == path && selector_matches(o, &selector))
                .map(|(_, _, ty, o)| line(&json!({"type": ty, "object": o})))
                .collect();
            backlog.push(line(&json!({"type": "BOOKMARK", "object": {
                "kind": kind, "apiVersion": api_version,
                "metadata": {"resourceVersion": st.rv.to_string()}}})));
            drop(st);
            let stream = async_stream(backlog, move |tx| async move {
                loop {
                    match live.recv().await {
                        Ok((c, ty, o)) if c == path && selector_matches(&o, &selector) => {
                            if tx
                                .send(Ok(line(&json!({"type": ty, "object": o}))))
                                .await
                                .is_err()
                            {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => return,
                    }
                }
            });
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(stream))
                .expect("response");
        }
        let items: Vec<Value> = st
            .objects
            .get(&path)
            .into_iter()
            .flat_map(|m| m.values())
            .filter(|o| selector_matches(o, &selector))
            .cloned()
            .collect();
        json_body(json!({
            "kind": format!("{kind}List"), "apiVersion": api_version,
            "metadata": {"resourceVersion": st.rv.to_string()},
            "items": items,
        }))
        .into_response()
    }
}

fn json_body(v: Value) -> Response {
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(line(&v)))
        .expect("response")
}

type Chunk = Result<axum::body::Bytes, std::io::Error>;

/// A body stream: `first` chunks, then whatever `produce` sends.
fn async_stream<F, Fut>(
    first: Vec<axum::body::Bytes>,
    produce: F,
) -> impl futures::Stream<Item = Chunk> + Send
where
    F: FnOnce(tokio::sync::mpsc::Sender<Chunk>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(produce(tx));
    futures::StreamExt::chain(
        futures::stream::iter(first.into_iter().map(Ok)),
        tokio_stream::wrappers::ReceiverStream::new(rx),
    )
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => {
                        out.push(v);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---------------------------------------------------------------- objects

/// An EndpointSlice of Service `service` with (ip, pod, ready) endpoints and an `http` port (and
/// a `metadata` port when given).
pub fn slice(
    name: &str,
    service: &str,
    port: u16,
    metadata_port: Option<u16>,
    eps: &[(&str, &str, bool)],
) -> Value {
    let mut ports = vec![json!({"name": "http", "port": port, "protocol": "TCP"})];
    if let Some(m) = metadata_port {
        ports.push(json!({"name": "metadata", "port": m, "protocol": "TCP"}));
    }
    json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": eps.iter().map(|(ip, pod, ready)| json!({
            "addresses": [ip],
            "conditions": {"ready": ready, "serving": ready, "terminating": false},
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"},
            "zone": "zone-a", "nodeName": "node-1",
        })).collect::<Vec<_>>(),
        "ports": ports,
    })
}

pub fn pool_v1(name: &str, port: u16) -> Value {
    json!({"metadata": {"name": name}, "spec": {
        "selector": {"matchLabels": {"kvepp.io/component": name}},
        "targetPorts": [{"number": port}],
        "endpointPickerRef": {"name": "kvepp", "port": {"number": 9002}}}})
}

pub fn model(name: &str, model_name: &str, pool: &str, targets: &[(&str, u32)]) -> Value {
    json!({"metadata": {"name": name}, "spec": {
        "modelName": model_name, "criticality": "Standard", "poolRef": {"name": pool},
        "targetModels": targets.iter().map(|(n, w)| json!({"name": n, "weight": w})).collect::<Vec<_>>()}})
}

/// An InferenceModelRewrite with one rule: `model` (None: the catch-all) to `target`.
pub fn rewrite(name: &str, pool: &str, model: Option<&str>, target: &str) -> Value {
    let matches: Vec<Value> = model
        .map(|m| json!({"model": {"type": "Exact", "value": m}}))
        .into_iter()
        .collect();
    json!({"metadata": {"name": name}, "spec": {"poolRef": {"name": pool},
        "rules": [{"matches": matches, "targets": [{"modelRewrite": target}]}]}})
}

pub fn objective(name: &str, priority: i32, pool: &str) -> Value {
    json!({"metadata": {"name": name}, "spec": {"priority": priority, "poolRef": {"name": pool}}})
}
