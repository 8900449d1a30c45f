//! The discovery interfaces every backend implements: the client side [`ServiceDiscovery`] (which instances of a
//! component are ready, and a stream of changes) and the server side [`ServiceRegistry`] (an
//! instance registers itself, publishes its metadata and says when it is ready).
//!
//! Terms, the same for every backend:
//! - `namespace` is the Kubernetes namespace of the pool;
//! - `component` is the Service that selects the instances' pods. Its EndpointSlices carry the label
//!   `kubernetes.io/service-name: <component>`, and its pods carry [`COMPONENT_LABEL`].
//! - An instance's id is its Pod's name (`targetRef.name`); when the slice names no Pod, its
//!   `ip:port` (or IP when the slice has no port).
//!
//! Invariants of a [`ServiceDiscovery::watch`] stream:
//! - after the first [`InstanceEvent::Synced`], the events applied in order give exactly the set
//!   of ready instances the backend knows;
//! - an id is never reported `Added` twice without a change of the instance in between, nor
//!   `Removed` when it was not present. A relist (after a dropped connection or a 410 Gone) only
//!   produces the difference.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::Stream;

use super::objects::{EndpointSlice, Object, SliceEndpoint, SERVICE_NAME_LABEL};
use crate::engine::metadata::{fetch_metadata, EngineMetadata, FetchMetadataError};

/// The pod label a component's Service selects on.
pub const COMPONENT_LABEL: &str = "kvepp.io/component";
/// The EndpointSlice port name where an instance serves `/metadata`.
pub const METADATA_PORT_NAME: &str = "metadata";

/// One ready instance of a component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    pub id: Arc<str>,
    pub ip: IpAddr,
    /// The serving port (slice port `http`, else its only port); `None`: the pool's target port.
    pub port: Option<u16>,
    /// Where `/metadata` is served (slice port named `metadata`).
    pub metadata_port: Option<u16>,
    pub zone: Option<Arc<str>>,
    pub node: Option<Arc<str>>,
}

#[derive(Debug, thiserror::Error)]
pub enum MetadataError {
    #[error("instance {0} has no `metadata` port")]
    NoPort(Arc<str>),
    #[error(transparent)]
    Fetch(#[from] FetchMetadataError),
}

impl Instance {
    /// `Instance.metadata()`: `GET /metadata` on the instance's metadata port.
    pub async fn metadata(&self, timeout: Duration) -> Result<EngineMetadata, MetadataError> {
        let port = self
            .metadata_port
            .ok_or_else(|| MetadataError::NoPort(self.id.clone()))?;
        Ok(fetch_metadata(SocketAddr::new(self.ip, port), timeout).await?)
    }
}

/// A change in the set of ready instances.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstanceEvent {
    /// A new ready instance, or a ready instance whose address, ports or topology changed.
    Added(Instance),
    /// The instance is no longer ready (unready, terminating, or gone).
    Removed(Arc<str>),
    /// The backend has seen a complete listing; everything before this describes it.
    Synced,
}

pub type InstanceStream = Pin<Box<dyn Stream<Item = InstanceEvent> + Send>>;

#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("Kubernetes API: {0}")]
    Kube(String),
    #[error("{0}")]
    Unavailable(String),
}

/// The client side: which instances of `(namespace, component)` are ready.
pub trait ServiceDiscovery: Send + Sync {
    /// All ready instances now.
    fn list_instances<'a>(
        &'a self,
        namespace: &'a str,
        component: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Instance>, DiscoveryError>>;

    /// Changes from now on, starting with the current set and a [`InstanceEvent::Synced`]. The
    /// stream retries on its own (errors are logged) and ends only when the backend shuts down.
    fn watch(&self, namespace: &str, component: &str) -> InstanceStream;
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{0}")]
    Labels(String),
    #[error("{0}")]
    Io(String),
}

/// The server side: an instance announces itself.
pub trait ServiceRegistry: Send + Sync {
    fn register_instance(
        &self,
        namespace: &str,
        component: &str,
    ) -> Result<InstanceHandle, RegistryError>;
}

/// What a registered instance publishes.
#[derive(Debug, Clone, Default)]
pub struct Published {
    pub metadata: Arc<EngineMetadata>,
    pub ready: bool,
}

type OnChange = Box<dyn Fn(&Published) + Send + Sync>;

/// A registered instance: its id, its metadata (served on `/metadata`) and its readiness (what the
/// pod's readiness probe reports). Clones share the state.
#[derive(Clone)]
pub struct InstanceHandle {
    id: Arc<str>,
    state: Arc<Mutex<Published>>,
    on_change: Arc<OnChange>,
}

impl std::fmt::Debug for InstanceHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstanceHandle")
            .field("id", &self.id)
            .field("state", &self.published())
            .finish()
    }
}

impl InstanceHandle {
    /// `on_change` sees every new state (a backend's hook: write a file, notify watchers).
    pub fn new(
        id: impl Into<Arc<str>>,
        on_change: impl Fn(&Published) + Send + Sync + 'static,
    ) -> Self {
        InstanceHandle {
            id: id.into(),
            state: Arc::default(),
            on_change: Arc::new(Box::new(on_change)),
        }
    }

    pub fn instance_id(&self) -> &str {
        &self.id
    }

    pub fn set_metadata(&self, metadata: EngineMetadata) {
        self.update(|s| s.metadata = Arc::new(metadata));
    }

    pub fn set_ready(&self, ready: bool) {
        self.update(|s| s.ready = ready);
    }

    pub fn published(&self) -> Published {
        self.state.lock().clone()
    }

    fn update(&self, f: impl FnOnce(&mut Published)) {
        let now = {
            let mut s = self.state.lock();
            f(&mut s);
            s.clone()
        };
        (self.on_change)(&now);
    }
}

/// The ready instances a set of EndpointSlices describes, keyed by id.
///
/// A pod listed in several slices is one instance: its first ready listing in slice-name order
/// wins, preferring one that names a port. An endpoint is ready unless `ready: false` or
/// `terminating: true` (a nil `ready` means ready, as in Kubernetes).
pub fn instances_from_slices<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> BTreeMap<Arc<str>, Instance> {
    let mut out: BTreeMap<Arc<str>, Instance> = BTreeMap::new();
    for slice in slices {
        let port = slice_port(slice);
        let metadata_port = named_port(slice, METADATA_PORT_NAME);
        for ep in slice.endpoints.iter().filter(|e| e.conditions.is_ready()) {
            let Some(inst) = instance(ep, port, metadata_port, &slice.metadata.name) else {
                continue;
            };
            match out.get_mut(&inst.id) {
                Some(existing) if existing.port.is_none() && inst.port.is_some() => {
                    *existing = inst
                }
                Some(_) => {}
                None => {
                    out.insert(inst.id.clone(), inst);
                }
            }
        }
    }
    out
}

/// The ready instances of `(namespace, component)` among a source's objects (its slices).
pub fn ready_in_objects<'a>(
    objects: impl IntoIterator<Item = &'a Object>,
    namespace: &str,
    component: &str,
) -> BTreeMap<Arc<str>, Instance> {
    instances_from_slices(objects.into_iter().filter_map(|o| match o {
        Object::Slice(s) if slice_matches(s, namespace, component) => Some(s),
        _ => None,
    }))
}

/// Slices in `namespace` that belong to `component` (label `kubernetes.io/service-name`).
pub fn slice_matches(slice: &EndpointSlice, namespace: &str, component: &str) -> bool {
    slice.metadata.namespace.as_deref().unwrap_or(namespace) == namespace
        && slice
            .metadata
            .labels
            .get(SERVICE_NAME_LABEL)
            .map(String::as_str)
            == Some(component)
}

fn instance(
    ep: &SliceEndpoint,
    port: Option<u16>,
    metadata_port: Option<u16>,
    slice: &str,
) -> Option<Instance> {
    let first = ep.addresses.first()?;
    let Ok(ip) = first.parse::<IpAddr>() else {
        tracing::warn!(slice, address = %first, "endpoint address is not an IP; skipped");
        return None;
    };
    let id: Arc<str> = match (ep.target_ref.as_ref().and_then(|r| r.name.as_deref()), port) {
        (Some(name), _) if !name.is_empty() => name.into(),
        (_, Some(p)) => SocketAddr::new(ip, p).to_string().into(),
        (_, None) => first.as_str().into(),
    };
    Some(Instance {
        id,
        ip,
        port,
        metadata_port,
        zone: ep.zone.as_deref().map(Arc::from),
        node: ep.node_name.as_deref().map(Arc::from),
    })
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

/// Turns successive complete views of the ready set into the events between them.
#[derive(Debug, Default)]
pub struct InstanceDiff {
    current: BTreeMap<Arc<str>, Instance>,
}

impl InstanceDiff {
    /// Events that take the last view to `next` (no event when nothing changed).
    pub fn update(&mut self, next: BTreeMap<Arc<str>, Instance>) -> Vec<InstanceEvent> {
        let mut events = Vec::new();
        for id in self.current.keys() {
            if !next.contains_key(id) {
                events.push(InstanceEvent::Removed(id.clone()));
            }
        }
        for (id, inst) in &next {
            if self.current.get(id) != Some(inst) {
                events.push(InstanceEvent::Added(inst.clone()));
            }
        }
        self.current = next;
        events
    }

    pub fn current(&self) -> &BTreeMap<Arc<str>, Instance> {
        &self.current
    }
}

/// Turns a stream of complete views of the ready set into a watch stream: the first view's
/// instances followed by [`InstanceEvent::Synced`], then the differences between views (a relist
/// is one more view, so it only adds what changed).
pub fn events_from_views(
    views: impl Stream<Item = BTreeMap<Arc<str>, Instance>> + Send + 'static,
) -> InstanceStream {
    use futures::StreamExt;
    let mut diff = InstanceDiff::default();
    let mut synced = false;
    Box::pin(
        views
            .map(move |view| {
                let mut events = diff.update(view);
                if !synced {
                    synced = true;
                    events.push(InstanceEvent::Synced);
                }
                futures::stream::iter(events)
            })
            .flatten(),
    )
}

/// The next event, within 10 s (tests).
#[cfg(test)]
pub(crate) async fn next_event(s: &mut InstanceStream) -> InstanceEvent {
    use futures::StreamExt;
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("an event within 10 s")
        .expect("stream open")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::objects::{parse_documents, Object};

    fn slices(yaml: &str) -> Vec<EndpointSlice> {
        parse_documents(yaml.as_bytes())
            .unwrap()
            .into_iter()
            .filter_map(|o| match o {
                Object::Slice(s) => Some(s),
                _ => None,
            })
            .collect()
    }

    const TWO: &str = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: a, labels: {kubernetes.io/service-name: svc}}
endpoints:
- {addresses: [10.0.0.1], targetRef: {name: pod-1}, zone: z1, nodeName: n1}
- {addresses: [10.0.0.2], targetRef: {name: pod-2}, conditions: {ready: false}}
- {addresses: [10.0.0.3], targetRef: {name: pod-3}, conditions: {ready: true, serving: true, terminating: true}}
- {addresses: [10.0.0.4]}
ports: [{name: http, port: 8000}, {name: metadata, port: 8090}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: b, labels: {kubernetes.io/service-name: svc}}
endpoints:
- {addresses: [10.0.0.1], targetRef: {name: pod-1}}
- {addresses: [10.0.0.5], targetRef: {name: pod-5}, conditions: {}}
"#;

    #[test]
    fn endpoint_slice_table_mapping() {
        let s = slices(TWO);
        let set = instances_from_slices(&s);
        let ids: Vec<&str> = set.keys().map(|k| &**k).collect();
        // unready (pod-2) and terminating (pod-3) are out; pod-1 is listed twice but is one
        // instance; no targetRef: the address is the id.
        assert_eq!(ids, ["10.0.0.4:8000", "pod-1", "pod-5"]);
        let p1 = &set["pod-1"];
        assert_eq!(
            (
                p1.port,
                p1.metadata_port,
                p1.zone.as_deref(),
                p1.node.as_deref()
            ),
            (Some(8000), Some(8090), Some("z1"), Some("n1"))
        );
        assert_eq!(set["pod-5"].port, None, "slice b has no port");
        assert!(slice_matches(&s[0], "default", "svc"));
        assert!(!slice_matches(&s[0], "default", "other"));
    }

    #[test]
    fn unnamed_endpoints_on_one_ip_are_distinct() {
        let two = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: a, labels: {kubernetes.io/service-name: svc}}
endpoints: [{addresses: [127.0.0.1]}]
ports: [{name: http, port: 8001}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: b, labels: {kubernetes.io/service-name: svc}}
endpoints: [{addresses: [127.0.0.1]}]
ports: [{name: http, port: 8002}]
"#;
        let set = instances_from_slices(&slices(two));
        let ids: Vec<&str> = set.keys().map(|k| &**k).collect();
        assert_eq!(ids, ["127.0.0.1:8001", "127.0.0.1:8002"]);
    }

    #[test]
    fn diff_reports_only_changes() {
        let mut d = InstanceDiff::default();
        let s = slices(TWO);
        let first = d.update(instances_from_slices(&s));
        assert_eq!(first.len(), 3);
        assert!(
            d.update(instances_from_slices(&s)).is_empty(),
            "same view, no event"
        );
        // pod-1 becomes unready in both slices; pod-2 becomes ready.
        let changed = TWO
            .replace(
                "targetRef: {name: pod-1}, zone",
                "targetRef: {name: pod-1}, conditions: {ready: false}, zone",
            )
            .replace("- {addresses: [10.0.0.1], targetRef: {name: pod-1}}\n", "")
            .replace(
                "conditions: {ready: false}}\n- {addresses: [10.0.0.3]",
                "conditions: {ready: true}}\n- {addresses: [10.0.0.3]",
            );
        let ev = d.update(instances_from_slices(&slices(&changed)));
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert_eq!(ev[0], InstanceEvent::Removed("pod-1".into()));
        assert!(matches!(&ev[1], InstanceEvent::Added(i) if &*i.id == "pod-2"));
    }

    #[test]
    fn handle_publishes_changes() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let h = InstanceHandle::new("pod-x", move |p| s.lock().push(p.ready));
        assert_eq!(h.instance_id(), "pod-x");
        assert!(!h.published().ready);
        h.set_ready(true);
        h.set_metadata(EngineMetadata {
            role: Some("both".into()),
            ..Default::default()
        });
        assert_eq!(h.published().metadata.role.as_deref(), Some("both"));
        assert_eq!(*seen.lock(), [true, true]);
    }
}
