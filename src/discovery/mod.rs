//! Service discovery: what the pool is, which models it serves and which endpoints are ready.
//!
//! Sources (the manifests directory now, the Kubernetes API later) produce an [`Inventory`] of
//! Kubernetes-shaped objects and hand it to the [`Datastore`], which keeps only what belongs to the
//! configured pool and publishes an immutable [`PoolSnapshot`]. The request path reads the snapshot
//! lock-free; load counters of an endpoint survive snapshot changes because they are keyed by
//! address.

mod manifests;
pub mod objects;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use manifests::ManifestDir;
pub use objects::{EndpointSlice, InferenceModel, InferencePool, Object};

use crate::selector::{Criticality, Endpoint, EndpointLoad};

/// Which pool this EPP serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    pub name: String,
    pub namespace: String,
    /// Service whose EndpointSlices hold the pool's endpoints (label `kubernetes.io/service-name`).
    pub service: String,
}

/// An InferenceModel as the request path uses it.
#[derive(Debug)]
pub struct ModelSpec {
    pub name: Arc<str>,
    pub criticality: Criticality,
    pub targets: Vec<(Arc<str>, u64)>,
    pub total_weight: u64,
}

impl ModelSpec {
    pub fn new(name: &str, criticality: Criticality, targets: Vec<(Arc<str>, u64)>) -> Self {
        let total_weight = targets.iter().map(|(_, w)| *w).sum();
        ModelSpec {
            name: name.into(),
            criticality,
            targets,
            total_weight,
        }
    }
}

/// The pool as a request sees it. Immutable; replaced as a whole on every change.
#[derive(Debug)]
pub struct PoolSnapshot {
    /// `None` until the InferencePool object has been seen.
    pub pool: Option<InferencePool>,
    pub models: HashMap<String, Arc<ModelSpec>>,
    /// Ready endpoints, deduplicated by address, sorted by address.
    pub endpoints: Vec<Arc<Endpoint>>,
}

impl PoolSnapshot {
    pub fn empty() -> Self {
        PoolSnapshot {
            pool: None,
            models: HashMap::new(),
            endpoints: Vec::new(),
        }
    }
}

/// Everything a source currently knows, before filtering by pool.
#[derive(Debug, Default, Clone)]
pub struct Inventory {
    pub objects: Vec<Object>,
}

/// Receives the pool's state from a source and serves snapshots to the request path.
pub struct Datastore {
    target: PoolRef,
    snapshot: ArcSwap<PoolSnapshot>,
    loads: Mutex<HashMap<SocketAddr, Arc<EndpointLoad>>>,
    ready: watch::Sender<bool>,
    on_change: Box<dyn Fn(&PoolSnapshot) + Send + Sync>,
}

impl std::fmt::Debug for Datastore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Datastore")
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl Datastore {
    /// `on_change` is called after every applied inventory (metrics hook).
    pub fn new(target: PoolRef, on_change: impl Fn(&PoolSnapshot) + Send + Sync + 'static) -> Self {
        Datastore {
            target,
            snapshot: ArcSwap::from_pointee(PoolSnapshot::empty()),
            loads: Mutex::new(HashMap::new()),
            ready: watch::channel(false).0,
            on_change: Box::new(on_change),
        }
    }

    pub fn target(&self) -> &PoolRef {
        &self.target
    }

    /// The current snapshot (lock-free).
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.snapshot.load_full()
    }

    /// Becomes true once the configured InferencePool has been seen (readiness).
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Replaces the pool's state with what `inventory` says.
    pub fn apply(&self, inventory: &Inventory) {
        let snap = self.build(inventory);
        tracing::info!(
            pool = %self.target.name,
            found = snap.pool.is_some(),
            models = snap.models.len(),
            ready_endpoints = snap.endpoints.len(),
            "pool state updated"
        );
        let synced = snap.pool.is_some();
        (self.on_change)(&snap);
        self.snapshot.store(Arc::new(snap));
        self.ready.send_replace(synced);
    }

    fn in_namespace(&self, ns: &Option<String>) -> bool {
        ns.as_deref().unwrap_or(&self.target.namespace) == self.target.namespace
    }

    fn build(&self, inv: &Inventory) -> PoolSnapshot {
        let mut snap = PoolSnapshot::empty();
        let mut slices = Vec::new();
        let mut models: BTreeMap<(String, String), &InferenceModel> = BTreeMap::new();
        for obj in &inv.objects {
            match obj {
                Object::Pool(p)
                    if p.name == self.target.name && self.in_namespace(&p.namespace) =>
                {
                    snap.pool = Some(p.clone());
                }
                Object::Model(m)
                    if m.pool_ref == self.target.name && self.in_namespace(&m.namespace) =>
                {
                    models.insert((m.model_name.clone(), m.name.clone()), m);
                }
                Object::Slice(s)
                    if self.in_namespace(&s.metadata.namespace)
                        && s.metadata.labels.get(objects::SERVICE_NAME_LABEL)
                            == Some(&self.target.service) =>
                {
                    slices.push(s);
                }
                _ => {}
            }
        }
        for ((model_name, object_name), m) in models {
            if let Some(existing) = snap.models.get(&model_name) {
                tracing::warn!(model = %model_name, kept = %existing.name, ignored = %object_name,
                    "two InferenceModels claim the same modelName; keeping the first by object name");
                continue;
            }
            let targets = m
                .target_models
                .iter()
                .map(|(n, w)| (Arc::from(n.as_str()), *w))
                .collect();
            snap.models.insert(
                model_name.clone(),
                Arc::new(ModelSpec::new(&model_name, m.criticality, targets)),
            );
        }
        let target_port = snap.pool.as_ref().map(|p| p.target_port);
        let mut loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
        let mut endpoints: BTreeMap<SocketAddr, Arc<Endpoint>> = BTreeMap::new();
        for slice in slices {
            let port = slice_port(slice).or(target_port);
            let metadata_port = named_port(slice, "metadata");
            for ep in slice.endpoints.iter().filter(|e| e.conditions.is_ready()) {
                let Some(addr) = serving_addr(ep, port, &slice.metadata.name) else {
                    continue;
                };
                endpoints.entry(addr).or_insert_with(|| {
                    let load = loads.entry(addr).or_default().clone();
                    let addr_str: Arc<str> = addr.to_string().into();
                    let name = ep
                        .target_ref
                        .as_ref()
                        .and_then(|r| r.name.as_deref())
                        .map(Arc::from);
                    Arc::new(Endpoint {
                        addr,
                        name: name.unwrap_or_else(|| addr_str.clone()),
                        addr_str,
                        zone: ep.zone.as_deref().map(Arc::from),
                        node: ep.node_name.as_deref().map(Arc::from),
                        metadata_port,
                        load,
                    })
                });
            }
        }
        // Forget counters of endpoints that are gone and that nothing refers to any more (no booking,
        // no older snapshot still in use).
        loads.retain(|addr, load| endpoints.contains_key(addr) || Arc::strong_count(load) > 1);
        snap.endpoints = endpoints.into_values().collect();
        snap
    }
}

/// The slice port named `http`, else the slice's only port.
fn slice_port(slice: &EndpointSlice) -> Option<u16> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let pick = ports
        .iter()
        .find(|p| p.name.as_deref() == Some("http"))
        .or(match ports {
            [only] => Some(only),
            _ => None,
        });
    pick.and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

/// The slice port with this name.
fn named_port(slice: &EndpointSlice, name: &str) -> Option<u16> {
    slice
        .ports
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|p| p.name.as_deref() == Some(name))
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p != 0)
}

fn serving_addr(ep: &objects::SliceEndpoint, port: Option<u16>, slice: &str) -> Option<SocketAddr> {
    let first = ep.addresses.first()?;
    let Ok(ip) = first.parse::<IpAddr>() else {
        tracing::warn!(slice, address = %first, "endpoint address is not an IP; skipped");
        return None;
    };
    let Some(port) = port else {
        tracing::warn!(slice, address = %first, "no port: slice has no `http` or single port and the pool has no target port; skipped");
        return None;
    };
    Some(SocketAddr::new(ip, port))
}

/// A source of pool state (manifests directory, Kubernetes API, …).
pub trait DiscoverySource: Send + 'static {
    /// Starts feeding `store` until `shutdown` turns true.
    fn spawn(
        self: Box<Self>,
        store: Arc<Datastore>,
        shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::objects::parse_documents;

    fn store() -> Datastore {
        Datastore::new(
            PoolRef {
                name: "pool".into(),
                namespace: "default".into(),
                service: "pool".into(),
            },
            |_| {},
        )
    }

    const OBJECTS: &str = r#"
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool}
spec: {targetPortNumber: 8000, selector: {app: vllm}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool, namespace: other}
spec: {targetPortNumber: 9999}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: m1}
spec: {modelName: llama, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: m2}
spec: {modelName: qwen, poolRef: {name: other-pool}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s1, labels: {kubernetes.io/service-name: pool}}
endpoints:
- {addresses: [10.0.0.1], targetRef: {name: pod-a}, zone: z}
- {addresses: [10.0.0.2], conditions: {ready: false}}
ports: [{name: metrics, port: 9000}, {name: http, port: 8001}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s2, labels: {kubernetes.io/service-name: pool}}
endpoints:
- {addresses: [10.0.0.3, 10.0.0.99]}
- {addresses: [10.0.0.5], targetRef: {name: pod-e}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s5, labels: {kubernetes.io/service-name: pool}}
endpoints: [{addresses: [10.0.0.5], targetRef: {name: pod-e}}]
ports: [{name: http, port: 8000}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s3, labels: {kubernetes.io/service-name: not-the-pool}}
endpoints: [{addresses: [10.0.0.4]}]
ports: [{port: 7000}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s4, labels: {kubernetes.io/service-name: pool}}
endpoints: [{addresses: ["::1"]}]
ports: [{name: grpc, port: 7001}]
"#;

    #[test]
    fn builds_pool_models_and_ready_endpoints() {
        let st = store();
        assert!(!*st.ready().borrow());
        st.apply(&Inventory {
            objects: parse_documents(OBJECTS.as_bytes()).unwrap(),
        });
        assert!(*st.ready().borrow());
        let snap = st.snapshot();
        assert_eq!(snap.pool.as_ref().unwrap().target_port, 8000);
        assert_eq!(snap.models.keys().collect::<Vec<_>>(), vec!["llama"]);
        let addrs: Vec<&str> = snap.endpoints.iter().map(|e| &*e.addr_str).collect();
        // s1: named `http` port; s2: no ports, pool target port, first address; s4: only port.
        // A pod listed in two slices (s2, s5) appears once.
        assert_eq!(
            addrs,
            vec![
                "10.0.0.1:8001",
                "10.0.0.3:8000",
                "10.0.0.5:8000",
                "[::1]:7001"
            ]
        );
        assert_eq!(&*snap.endpoints[0].name, "pod-a");
        assert_eq!(snap.endpoints[0].zone.as_deref(), Some("z"));
        assert_eq!(&*snap.endpoints[1].name, "10.0.0.3:8000");
        assert_eq!(&*snap.endpoints[2].name, "pod-e");
    }

    #[test]
    fn load_survives_updates_and_is_forgotten_when_idle() {
        let st = store();
        let objs = parse_documents(OBJECTS.as_bytes()).unwrap();
        st.apply(&Inventory {
            objects: objs.clone(),
        });
        let booking = st.snapshot().endpoints[0].load.book();
        st.apply(&Inventory {
            objects: objs.clone(),
        });
        assert_eq!(st.snapshot().endpoints[0].load.in_flight(), 1);
        // Endpoint disappears while a request is in flight, then comes back: count kept.
        st.apply(&Inventory::default());
        assert!(!*st.ready().borrow(), "no pool, not ready");
        st.apply(&Inventory {
            objects: objs.clone(),
        });
        assert_eq!(st.snapshot().endpoints[0].load.in_flight(), 1);
        drop(booking);
        // Pruned once no snapshot or booking refers to the counters (the update after removal).
        st.apply(&Inventory::default());
        st.apply(&Inventory::default());
        assert!(st.loads.lock().unwrap().is_empty());
    }
}
