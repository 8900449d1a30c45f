//! Service discovery: what the pool is, which models it serves and which endpoints are ready.
//!
//! Two feeds fill the [`Datastore`]:
//! - the *catalog*: InferencePool, InferenceModel and InferenceObjective objects (from the
//!   manifests directory or the Kubernetes API), kept only when they belong to the configured
//!   pool (and, when kvepp knows its own Service, only a pool that names it as its picker);
//! - the *instances*: the ready endpoints, fed only through the [`ServiceDiscovery`] interface
//!   ([`service`]), whatever the backend ([`ManifestDir`], [`kubernetes`], [`memory`]).
//!
//! The datastore publishes an immutable [`PoolSnapshot`] after every change; the request path reads
//! it lock-free, and background tasks wait on [`Datastore::watch`] (the ready endpoints) instead of
//! polling. Load counters of an endpoint survive snapshot changes because they are keyed by
//! address. The store is ready once the pool has been seen and the instances have synced.

pub(crate) mod cluster_topology;
pub mod kubernetes;
mod manifests;
pub mod memory;
pub mod objects;
pub mod service;

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use futures::StreamExt;
use tokio::sync::watch;

pub use manifests::{ManifestDir, ManifestRegistry};
pub use objects::{
    EndpointSlice, FailureMode, InferenceModel, InferenceModelRewrite, InferenceObjective,
    InferencePool, Object, RewriteRule,
};
pub use service::{
    Instance, InstanceEvent, InstanceHandle, InstanceStream, ServiceDiscovery, ServiceRegistry,
};

use kvepp_core::disagg::Domains;
use kvepp_core::{Criticality, Endpoint, EndpointLoad, Role};

/// Which pool this EPP serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRef {
    pub name: String,
    pub namespace: String,
    /// Service whose EndpointSlices hold the pool's endpoints (label `kubernetes.io/service-name`):
    /// the discovery `component`.
    pub service: String,
    /// kvepp's own Service: a pool whose picker reference names another Service is not served.
    /// `None`: not checked.
    pub picker_service: Option<String>,
}

/// Weighted target models (an InferenceModel's `targetModels`, a rewrite rule's `targets`).
#[derive(Debug, Clone, Default)]
pub struct Targets {
    /// (model name, weight), in the object's order.
    pub list: Vec<(Arc<str>, u64)>,
    /// The weights' sum (0: no target can be drawn).
    pub total: u64,
}

impl Targets {
    pub(crate) fn new(list: Vec<(Arc<str>, u64)>) -> Self {
        let total = list.iter().map(|(_, w)| *w).sum();
        Targets { list, total }
    }

    fn of(list: &[(String, u64)]) -> Self {
        Targets::new(
            list.iter()
                .map(|(n, w)| (Arc::from(n.as_str()), *w))
                .collect(),
        )
    }
}

/// An InferenceModel as the request path uses it.
#[derive(Debug)]
pub struct ModelSpec {
    pub name: Arc<str>,
    pub criticality: Criticality,
    pub targets: Targets,
}

impl ModelSpec {
    #[cfg(test)]
    pub(crate) fn new(name: &str, criticality: Criticality, targets: Vec<(Arc<str>, u64)>) -> Self {
        ModelSpec {
            name: name.into(),
            criticality,
            targets: Targets::new(targets),
        }
    }
}

/// One InferenceModelRewrite rule as the request path uses it.
#[derive(Debug)]
pub struct RewriteSpec {
    /// The InferenceModelRewrite's name (logs, traces).
    pub object: Arc<str>,
    pub targets: Targets,
}

/// The pool's InferenceModelRewrites, compiled: an exact match first, else the catch-all.
///
/// Precedence, stated once: within an object its rules apply in order (a rule after the
/// object's catch-all is never reached); across objects an exact match beats a catch-all, and
/// of two objects claiming one model (or both with a catch-all) the older is kept
/// (`creationTimestamp`, then name), the other's rule ignored, logged and counted in
/// [`Rewrites::conflicts`].
#[derive(Debug, Default)]
pub struct Rewrites {
    pub exact: HashMap<String, Arc<RewriteSpec>>,
    pub catch_all: Option<Arc<RewriteSpec>>,
    /// Claims ignored because an older object (or an earlier catch-all rule of the same object)
    /// took the model first.
    pub conflicts: usize,
}

impl Rewrites {
    /// The rule a request for `model` follows, and whether it matched the model by name (false:
    /// the catch-all).
    pub fn rule(&self, model: &str) -> Option<(&RewriteSpec, bool)> {
        match self.exact.get(model) {
            Some(r) => Some((r, true)),
            None => self.catch_all.as_deref().map(|r| (r, false)),
        }
    }

    fn compile(mut objects: Vec<&InferenceModelRewrite>) -> Self {
        // Oldest first; objects without a timestamp (manifests) by name.
        objects.sort_by(|a, b| (&a.created, &a.name).cmp(&(&b.created, &b.name)));
        let mut out = Rewrites::default();
        let mut owner: HashMap<&str, &str> = HashMap::new();
        let mut catch_all_owner: Option<&str> = None;
        for obj in objects {
            let mut own_catch_all = false;
            for (i, rule) in obj.rules.iter().enumerate() {
                let spec = Arc::new(RewriteSpec {
                    object: obj.name.as_str().into(),
                    targets: Targets::of(&rule.targets),
                });
                if own_catch_all {
                    tracing::warn!(rewrite = %obj.name, rule = i,
                        "InferenceModelRewrite rule follows the object's catch-all rule and is never reached; ignored");
                    out.conflicts += 1;
                    continue;
                }
                if rule.models.is_empty() {
                    own_catch_all = true;
                    match catch_all_owner {
                        Some(kept) => {
                            tracing::warn!(rewrite = %obj.name, rule = i, kept = %kept,
                                "two InferenceModelRewrites have a catch-all rule; keeping the older one's");
                            out.conflicts += 1;
                        }
                        None => {
                            catch_all_owner = Some(&obj.name);
                            out.catch_all = Some(spec);
                        }
                    }
                    continue;
                }
                for model in &rule.models {
                    match owner.get(model.as_str()) {
                        // An earlier rule of the same object took it: first rule wins, as written.
                        Some(kept) if *kept == obj.name => {}
                        Some(kept) => {
                            tracing::warn!(model = %model, rewrite = %obj.name, kept = %kept,
                                "two InferenceModelRewrites claim the same model; keeping the older one's rule");
                            out.conflicts += 1;
                        }
                        None => {
                            owner.insert(model, &obj.name);
                            out.exact.insert(model.clone(), spec.clone());
                        }
                    }
                }
            }
        }
        out
    }
}

/// The pool as a request sees it. Immutable; replaced as a whole on every change.
#[derive(Debug)]
pub struct PoolSnapshot {
    /// `None` until the InferencePool object has been seen.
    pub pool: Option<InferencePool>,
    pub models: HashMap<String, Arc<ModelSpec>>,
    /// InferenceModelRewrites of the pool, compiled.
    pub rewrites: Rewrites,
    /// InferenceObjectives of the pool: name → priority.
    pub objectives: HashMap<String, i32>,
    /// Ready endpoints, deduplicated by address, sorted by address (set through
    /// [`Self::set_endpoints`]).
    pub endpoints: Vec<Arc<Endpoint>>,
    /// Names `endpoints` for the router ([`kvepp_core::PickRequest::list`]): a number no other
    /// list of this process ever had, drawn anew whenever they are set.
    pub serial: u64,
}

/// Serial numbers of endpoint lists (0 is never one).
static SERIALS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl PoolSnapshot {
    pub(crate) fn empty() -> Self {
        PoolSnapshot {
            pool: None,
            models: HashMap::new(),
            rewrites: Rewrites::default(),
            objectives: HashMap::new(),
            endpoints: Vec::new(),
            serial: SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Sets the ready endpoints, with a serial number of their own.
    pub(crate) fn set_endpoints(&mut self, endpoints: Vec<Arc<Endpoint>>) {
        self.endpoints = endpoints;
        self.serial = SERIALS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Everything a source currently knows, before filtering by pool.
#[derive(Debug, Default, Clone)]
pub struct Inventory {
    pub objects: Vec<Object>,
}

#[derive(Debug, Default)]
struct State {
    catalog: Vec<Object>,
    instances: BTreeMap<Arc<str>, Instance>,
    instances_synced: bool,
    /// What endpoints' `/metadata` says about their role and topology, by address.
    facts: HashMap<SocketAddr, EndpointFacts>,
}

/// What an endpoint's metadata says about its place in a disaggregated pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointFacts {
    pub role: Role,
    /// `topology_domains`: level → value.
    pub domains: Domains,
}

/// Receives the pool's state from its feeds and serves snapshots to the request path.
pub struct Datastore {
    target: PoolRef,
    snapshot: ArcSwap<PoolSnapshot>,
    state: Mutex<State>,
    loads: Mutex<HashMap<SocketAddr, Arc<EndpointLoad>>>,
    ready: watch::Sender<bool>,
    /// The ready endpoints, for background tasks that react to membership changes.
    changes: watch::Sender<Arc<[Arc<Endpoint>]>>,
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
    /// `on_change` is called after every applied change (metrics hook).
    pub fn new(target: PoolRef, on_change: impl Fn(&PoolSnapshot) + Send + Sync + 'static) -> Self {
        Datastore {
            target,
            snapshot: ArcSwap::from_pointee(PoolSnapshot::empty()),
            state: Mutex::default(),
            loads: Mutex::new(HashMap::new()),
            ready: watch::channel(false).0,
            changes: watch::channel(Arc::from(Vec::new())).0,
            on_change: Box::new(on_change),
        }
    }

    pub(crate) fn target(&self) -> &PoolRef {
        &self.target
    }

    /// The current snapshot (lock-free).
    pub fn snapshot(&self) -> Arc<PoolSnapshot> {
        self.snapshot.load_full()
    }

    /// The ready endpoints, updated with every new snapshot (background tasks wait on this
    /// instead of polling).
    pub(crate) fn watch(&self) -> watch::Receiver<Arc<[Arc<Endpoint>]>> {
        self.changes.subscribe()
    }

    /// True once the configured InferencePool has been seen and the instances have synced.
    pub(crate) fn ready(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    /// Replaces the catalog (pools and models; other objects are ignored).
    pub(crate) fn apply_catalog(&self, objects: &[Object]) {
        self.change(|st| st.catalog = catalog_of(objects));
    }

    /// Applies instance events from a [`ServiceDiscovery`] watch, in order.
    pub(crate) fn apply_instances(&self, events: &[InstanceEvent]) {
        self.change(|st| {
            for ev in events {
                match ev {
                    InstanceEvent::Added(i) => {
                        st.instances.insert(i.id.clone(), i.clone());
                    }
                    InstanceEvent::Removed(id) => {
                        st.instances.remove(id);
                    }
                    InstanceEvent::Synced => st.instances_synced = true,
                }
            }
        });
    }

    /// Records what `addr`'s metadata says of its role and topology (None: no document); a new
    /// snapshot only when that changes.
    pub(crate) fn apply_metadata(&self, addr: SocketAddr, facts: Option<EndpointFacts>) {
        {
            let st = self.state.lock();
            if st.facts.get(&addr) == facts.as_ref() {
                return;
            }
        }
        self.change(|st| match facts {
            Some(f) => {
                st.facts.insert(addr, f);
            }
            None => {
                st.facts.remove(&addr);
            }
        });
    }

    /// Replaces everything with what `inventory` says: its pools and models, and the ready
    /// endpoints of its slices that belong to the pool's Service (a complete, synced view).
    pub fn apply(&self, inventory: &Inventory) {
        let t = &self.target;
        let instances = service::ready_in_objects(&inventory.objects, &t.namespace, &t.service);
        self.change(|st| {
            st.catalog = catalog_of(&inventory.objects);
            st.instances = instances;
            st.instances_synced = true;
        });
    }

    fn change(&self, f: impl FnOnce(&mut State)) {
        let mut st = self.state.lock();
        f(&mut st);
        let snap = self.build(&st);
        let synced = snap.pool.is_some() && st.instances_synced;
        drop(st);
        tracing::debug!(
            pool = %self.target.name,
            found = snap.pool.is_some(),
            models = snap.models.len(),
            rewritten_models = snap.rewrites.exact.len(),
            objectives = snap.objectives.len(),
            ready_endpoints = snap.endpoints.len(),
            "pool state updated"
        );
        (self.on_change)(&snap);
        let old = self.snapshot.load();
        if old.endpoints.len() != snap.endpoints.len()
            || old.models.len() != snap.models.len()
            || old.rewrites.exact.len() != snap.rewrites.exact.len()
            || old.rewrites.catch_all.is_some() != snap.rewrites.catch_all.is_some()
            || old.objectives != snap.objectives
            || old.pool != snap.pool
        {
            tracing::info!(pool = %self.target.name, found = snap.pool.is_some(),
                models = snap.models.len(), rewritten_models = snap.rewrites.exact.len(),
                catch_all_rewrite = snap.rewrites.catch_all.is_some(),
                objectives = snap.objectives.len(), ready_endpoints = snap.endpoints.len(), "pool state changed");
        }
        let endpoints: Arc<[Arc<Endpoint>]> = snap.endpoints.clone().into();
        self.snapshot.store(Arc::new(snap));
        self.changes.send_replace(endpoints);
        self.ready
            .send_if_modified(|r| std::mem::replace(r, synced) != synced);
    }

    fn in_namespace(&self, ns: &Option<String>) -> bool {
        ns.as_deref().unwrap_or(&self.target.namespace) == self.target.namespace
    }

    fn build(&self, st: &State) -> PoolSnapshot {
        let mut snap = PoolSnapshot::empty();
        let mut models: BTreeMap<(String, String), &InferenceModel> = BTreeMap::new();
        let mut rewrites = Vec::new();
        for obj in &st.catalog {
            match obj {
                Object::Pool(p)
                    if p.name == self.target.name && self.in_namespace(&p.namespace) =>
                {
                    match (&self.target.picker_service, &p.picker) {
                        (Some(mine), Some(named)) if mine != named => {
                            tracing::warn!(pool = %p.name, names = %named, this_picker = %mine,
                                "the InferencePool names another endpoint picker; not serving it");
                        }
                        _ => snap.pool = Some(p.clone()),
                    }
                }
                Object::Objective(o)
                    if o.pool_ref == self.target.name && self.in_namespace(&o.namespace) =>
                {
                    snap.objectives.insert(o.name.clone(), o.priority);
                }
                Object::Model(m)
                    if m.pool_ref == self.target.name && self.in_namespace(&m.namespace) =>
                {
                    models.insert((m.model_name.clone(), m.name.clone()), m);
                }
                Object::Rewrite(r)
                    if r.pool_ref == self.target.name && self.in_namespace(&r.namespace) =>
                {
                    rewrites.push(r);
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
            let spec = ModelSpec {
                name: model_name.as_str().into(),
                criticality: m.criticality,
                targets: Targets::of(&m.target_models),
            };
            snap.models.insert(model_name, Arc::new(spec));
        }
        snap.rewrites = Rewrites::compile(rewrites);
        let target_port = snap.pool.as_ref().and_then(InferencePool::target_port);
        // Several target ports: one endpoint per (pod, port), the port's index its rank.
        let ranks: &[u16] = match &snap.pool {
            Some(p) if p.target_ports.len() > 1 => &p.target_ports,
            _ => &[],
        };
        let mut loads = self.loads.lock();
        let mut endpoints: BTreeMap<SocketAddr, Arc<Endpoint>> = BTreeMap::new();
        for inst in st.instances.values() {
            let ports: Vec<(u16, Option<u32>)> = if ranks.is_empty() {
                let Some(port) = inst.port.or(target_port) else {
                    tracing::debug!(instance = %inst.id, "no port: slice has no `http` or single port and the pool has no target port yet; skipped");
                    continue;
                };
                vec![(port, None)]
            } else {
                ranks
                    .iter()
                    .zip(0u32..)
                    .map(|(&p, r)| (p, Some(r)))
                    .collect()
            };
            for (port, dp_rank) in ports {
                let addr = SocketAddr::new(inst.ip, port);
                endpoints.entry(addr).or_insert_with(|| {
                    endpoint(inst, addr, dp_rank, st.facts.get(&addr), &mut loads)
                });
            }
        }
        // Forget counters of endpoints that are gone and that nothing refers to any more (no booking,
        // no older snapshot still in use).
        loads.retain(|addr, load| endpoints.contains_key(addr) || Arc::strong_count(load) > 1);
        snap.set_endpoints(endpoints.into_values().collect());
        snap
    }
}

/// The endpoint of `inst` at `addr` (rank `dp_rank` of a multi-port pool), with its metadata's
/// role and topology; the EndpointSlice's zone and node fill in the `zone` and `host` levels the
/// metadata does not name.
fn endpoint(
    inst: &Instance,
    addr: SocketAddr,
    dp_rank: Option<u32>,
    facts: Option<&EndpointFacts>,
    loads: &mut HashMap<SocketAddr, Arc<EndpointLoad>>,
) -> Arc<Endpoint> {
    let load = loads.entry(addr).or_default().clone();
    let addr_str: Arc<str> = addr.to_string().into();
    // Instances without a Pod name are known by their address.
    let unnamed =
        inst.id.parse::<SocketAddr>().is_ok() || inst.id.parse::<std::net::IpAddr>().is_ok();
    let name: Arc<str> = match (unnamed, dp_rank) {
        (true, _) => addr_str.clone(),
        (false, None) => inst.id.clone(),
        (false, Some(r)) => format!("{}-rank-{r}", inst.id).into(),
    };
    let mut domains = facts.map(|f| f.domains.clone()).unwrap_or_default();
    for (level, value) in [("zone", &inst.zone), ("host", &inst.node)] {
        if let Some(v) = value {
            domains
                .entry(level.to_owned())
                .or_insert_with(|| v.to_string());
        }
    }
    let mut endpoint = Endpoint::new(addr, name);
    endpoint.zone = inst.zone.clone();
    endpoint.node = inst.node.clone();
    endpoint.metadata_port = inst.metadata_port;
    endpoint.load = load;
    endpoint.role = facts.map_or(Role::Both, |f| f.role);
    endpoint.domains = domains;
    endpoint.dp_rank = dp_rank;
    Arc::new(endpoint)
}

/// The objects of a source that form the catalog: pools and models.
fn catalog_of(objects: &[Object]) -> Vec<Object> {
    objects
        .iter()
        .filter(|o| {
            matches!(
                o,
                Object::Pool(_) | Object::Model(_) | Object::Objective(_) | Object::Rewrite(_)
            )
        })
        .cloned()
        .collect()
}

/// Feeds `store` from `discovery.watch(pool namespace, pool service)` until `shutdown`. Events that
/// are already waiting are applied together (one snapshot per batch).
pub(crate) async fn feed_instances(
    store: Arc<Datastore>,
    discovery: Arc<dyn ServiceDiscovery>,
    mut shutdown: watch::Receiver<bool>,
) {
    let target = store.target().clone();
    let mut events = discovery.watch(&target.namespace, &target.service);
    let mut batch = Vec::new();
    loop {
        let first = tokio::select! {
            e = events.next() => e,
            _ = shutdown.changed() => return,
        };
        let Some(first) = first else {
            // A source that ends because kvepp is stopping is not news.
            if !*shutdown.borrow() {
                tracing::warn!("discovery watch ended");
            }
            return;
        };
        batch.push(first);
        while let Some(Some(more)) = futures::FutureExt::now_or_never(events.next()) {
            batch.push(more);
        }
        store.apply_instances(&batch);
        batch.clear();
    }
}

/// Discovery's counters, registered by discovery itself (`metrics::Register`): ready endpoints,
/// manifest files that failed to parse, API objects that could not be used.
#[derive(Debug, Clone, Default)]
pub struct DiscoveryCounters {
    pub ready_endpoints: prometheus_client::metrics::gauge::Gauge,
    /// InferenceModelRewrite rules ignored now (an older object claims their model first).
    pub rewrite_conflicts: prometheus_client::metrics::gauge::Gauge,
    pub manifest_errors: prometheus_client::metrics::counter::Counter,
    pub catalog_invalid: prometheus_client::metrics::counter::Counter,
}

impl crate::metrics::Register for DiscoveryCounters {
    fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "ready_endpoints",
            "Ready endpoints in the pool",
            self.ready_endpoints.clone(),
        );
        registry.register(
            "model_rewrite_conflicts",
            "InferenceModelRewrite rules ignored because an older object (or an earlier catch-all rule of the same object) claims their model",
            self.rewrite_conflicts.clone(),
        );
        registry.register(
            "manifest_errors",
            "Manifest file versions that failed to parse",
            self.manifest_errors.clone(),
        );
        registry.register(
            "catalog_invalid_objects",
            "Inference objects (pools, models, objectives, rewrites) from the API server that kvepp could not use",
            self.catalog_invalid.clone(),
        );
    }
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
                picker_service: None,
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
    fn roles_and_topology_from_metadata_then_the_slice_and_one_endpoint_per_target_port() {
        let st = store();
        let objects = r#"
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: pool}
spec: {selector: {matchLabels: {app: v}}, targetPorts: [{number: 8000}, {number: 8001}], endpointPickerRef: {name: kvepp}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: s1, labels: {kubernetes.io/service-name: pool}}
endpoints: [{addresses: [10.0.0.1], targetRef: {name: pod-a}, zone: z1, nodeName: n1}]
ports: [{name: metadata, port: 8090}]
"#;
        st.apply(&Inventory {
            objects: parse_documents(objects.as_bytes()).unwrap(),
        });
        let snap = st.snapshot();
        let got: Vec<(&str, &str, Option<u32>)> = snap
            .endpoints
            .iter()
            .map(|e| (&*e.addr_str, &*e.name, e.dp_rank))
            .collect();
        assert_eq!(
            got,
            [
                ("10.0.0.1:8000", "pod-a-rank-0", Some(0)),
                ("10.0.0.1:8001", "pod-a-rank-1", Some(1))
            ]
        );
        // No metadata yet: both, and the slice's zone and node as `zone` and `host`.
        let e = &snap.endpoints[1];
        assert_eq!(e.role, Role::Both);
        assert_eq!(
            (e.domain("zone"), e.domain("host")),
            (Some("z1"), Some("n1"))
        );
        assert_eq!(e.metadata_port, Some(8090));
        // The metadata's role and domains win; levels it does not name still come from the slice.
        let addr: SocketAddr = "10.0.0.1:8001".parse().unwrap();
        let facts = EndpointFacts {
            role: Role::Decode,
            domains: Domains::from([
                ("zone".into(), "us-east-1a".into()),
                ("rack".into(), "r7".into()),
            ]),
        };
        st.apply_metadata(addr, Some(facts.clone()));
        let snap = st.snapshot();
        let e = &snap.endpoints[1];
        assert_eq!(e.role, Role::Decode);
        assert_eq!(
            (e.domain("zone"), e.domain("rack"), e.domain("host")),
            (Some("us-east-1a"), Some("r7"), Some("n1"))
        );
        assert_eq!(
            snap.endpoints[0].role,
            Role::Both,
            "only that rank's metadata"
        );
        // Unchanged facts make no new snapshot; dropped metadata restores the defaults.
        st.apply_metadata(addr, Some(facts));
        assert!(Arc::ptr_eq(&snap, &st.snapshot()));
        st.apply_metadata(addr, None);
        assert_eq!(st.snapshot().endpoints[1].role, Role::Both);
    }

    #[test]
    fn builds_pool_models_and_ready_endpoints() {
        let st = store();
        assert!(!*st.ready().borrow());
        st.apply(&Inventory {
            objects: parse_documents(OBJECTS.as_bytes()).unwrap(),
        });
        assert!(*st.ready().borrow());
        let snap = st.snapshot();
        assert_eq!(snap.pool.as_ref().unwrap().target_port(), Some(8000));
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
        assert!(st.loads.lock().is_empty());
    }

    #[test]
    fn instances_feed_endpoints_and_readiness_waits_for_sync() {
        let st = store();
        let objs = parse_documents(OBJECTS.as_bytes()).unwrap();
        st.apply_catalog(&objs);
        assert!(!*st.ready().borrow(), "pool seen, instances not synced");
        assert!(
            st.snapshot().endpoints.is_empty(),
            "slices in the catalog are ignored"
        );
        let inst = Instance {
            id: "pod-a".into(),
            ip: [10, 0, 0, 7].into(),
            port: None,
            metadata_port: Some(9),
            zone: None,
            node: None,
        };
        st.apply_instances(&[InstanceEvent::Added(inst.clone()), InstanceEvent::Synced]);
        assert!(*st.ready().borrow());
        let snap = st.snapshot();
        assert_eq!(
            &*snap.endpoints[0].addr_str, "10.0.0.7:8000",
            "pool target port"
        );
        assert_eq!(snap.endpoints[0].metadata_port, Some(9));
        st.apply_instances(&[InstanceEvent::Removed("pod-a".into())]);
        assert!(st.snapshot().endpoints.is_empty());
        assert!(*st.ready().borrow(), "an empty pool is still a synced pool");
    }
}
