//! The Kubernetes backend, on the real `kube` client.
//!
//! - [`KubeDiscovery`]: the EndpointSlice discovery behind [`ServiceDiscovery`]. `watch(namespace, component)` watches
//!   `discovery.k8s.io/v1` EndpointSlices labelled `kubernetes.io/service-name=<component>` and maps
//!   them with [`instances_from_slices`] (the EndpointSlice-to-instance event table).
//! - [`KubeCatalog`]: watches InferencePool (`v1alpha2` and `v1`), InferenceModel (`v1alpha2`),
//!   InferenceObjective (`llm-d.ai/v1alpha2`) and InferenceModelRewrite (`llm-d.ai/v1alpha2` and
//!   `inference.networking.x-k8s.io/v1alpha2`)
//!   in the pool's namespace and hands them to the datastore once every kind has synced.
//! - [`KubeRegistry`]: the server side inside a pod: checks the Downward API labels.
//!
//! Watching uses kube-runtime's watcher: list, then watch from the list's resourceVersion with
//! bookmarks; a 410 Gone or a failed watch start relists; errors back off exponentially. Each
//! (re)list is an `Init … InitDone` sequence that is buffered and applied as one complete view, so
//! a reconnect can neither lose nor duplicate an instance. A kind whose CRD is not installed
//! (404) counts as synced and empty, and is retried with backoff.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use k8s_openapi::api::discovery::v1 as k8s;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use tokio::sync::watch;

use super::objects::{
    self, Conditions, EndpointSlice, Object, ObjectMeta, ObjectReference, SliceEndpoint, SlicePort,
    SERVICE_NAME_LABEL,
};
use super::service::{
    events_from_views, instances_from_slices, DiscoveryError, Instance, InstanceHandle,
    InstanceStream, RegistryError, ServiceDiscovery, ServiceRegistry, COMPONENT_LABEL,
};
use super::Datastore;
use crate::metrics::{Register, ResourceLabels};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

/// How the client finds the API server: an explicit kubeconfig file, else what every Kubernetes
/// tool infers (`KUBECONFIG`, `~/.kube/config`, then the in-cluster service account).
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, DiscoveryError> {
    let err = |e: &dyn std::fmt::Display| DiscoveryError::Kube(e.to_string());
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| err(&format!("{}: {e}", path.display())))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| err(&e))?
        }
        None => kube::Config::infer().await.map_err(|e| err(&e))?,
    };
    kube::Client::try_from(config).map_err(|e| err(&e))
}

/// Kubernetes watches: errors and (re)lists, by watched resource, and which resources the API
/// server currently refuses kvepp (401/403).
#[derive(Debug, Clone, Default)]
pub struct WatchMetrics {
    pub errors: Family<ResourceLabels, Counter>,
    pub relists: Family<ResourceLabels, Counter>,
    pub refused: Family<ResourceLabels, Gauge>,
}

impl WatchMetrics {
    fn set_refused(&self, resource: &'static str, refused: bool) {
        self.refused
            .get_or_create(&ResourceLabels { resource })
            .set(i64::from(refused));
    }
    pub(crate) fn error(&self, resource: &'static str) {
        self.errors
            .get_or_create(&ResourceLabels { resource })
            .inc();
    }
    pub(crate) fn relist(&self, resource: &'static str) {
        self.relists
            .get_or_create(&ResourceLabels { resource })
            .inc();
    }
}

impl Register for WatchMetrics {
    fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "discovery_watch_errors",
            "Kubernetes list/watch errors, by resource (each is retried with backoff)",
            self.errors.clone(),
        );
        registry.register(
            "discovery_relists",
            "Kubernetes full lists, by resource (start, 410 Gone, or failed watch)",
            self.relists.clone(),
        );
        registry.register(
            "discovery_refused",
            "1 while the Kubernetes API server refuses kvepp's list or watch of a resource (401: the token; 403: RBAC), by resource",
            self.refused.clone(),
        );
    }
}

/// What one watched kind looks like to its consumer.
enum Step<T> {
    /// A complete view (after a list, or after a change while watching).
    View(BTreeMap<String, T>),
    /// Nothing to publish (inside a relist, or an error that the watcher retries).
    Nothing,
}

/// Folds a kube watcher stream into complete views keyed by object name. `convert` drops objects
/// it cannot use (returns `None`). With `absent_is_empty` (CRDs), a 404 on the list is an empty,
/// synced view; otherwise it is an error like any other.
fn views<K, T>(
    stream: impl Stream<Item = Result<Event<K>, watcher::Error>> + Send + 'static,
    resource: &'static str,
    absent_is_empty: bool,
    metrics: WatchMetrics,
    convert: impl Fn(K) -> Option<(String, T)> + Send + 'static,
) -> impl Stream<Item = BTreeMap<String, T>> + Send
where
    K: kube::Resource + Send + 'static,
    T: Clone + Send + 'static,
{
    let mut current: BTreeMap<String, T> = BTreeMap::new();
    let mut relist: Option<BTreeMap<String, T>> = None;
    let mut warned = false;
    stream
        .map(move |ev| {
            let step = match ev {
                Ok(Event::Init) => {
                    metrics.relist(resource);
                    relist = Some(BTreeMap::new());
                    Step::Nothing
                }
                Ok(Event::InitApply(obj)) => {
                    if let (Some(buf), Some((k, v))) = (relist.as_mut(), convert(obj)) {
                        buf.insert(k, v);
                    }
                    Step::Nothing
                }
                Ok(Event::InitDone) => {
                    metrics.set_refused(resource, false);
                    if warned {
                        tracing::info!(resource, "watch recovered");
                        warned = false;
                    }
                    current = relist.take().unwrap_or_default();
                    Step::View(current.clone())
                }
                Ok(Event::Apply(obj)) => match convert(obj) {
                    Some((k, v)) => {
                        current.insert(k, v);
                        Step::View(current.clone())
                    }
                    None => Step::Nothing,
                },
                Ok(Event::Delete(obj)) => {
                    // Only the name matters; a deleted invalid object is not reported again.
                    current.remove(obj.meta().name.as_deref().unwrap_or_default());
                    Step::View(current.clone())
                }
                Err(e) if absent_is_empty && is_not_found(&e) => {
                    // The CRD (or API version) is not installed: synced and empty until it is.
                    if !warned {
                        tracing::info!(
                            resource,
                            "resource not served by the API server; treated as empty, retrying"
                        );
                        warned = true;
                    }
                    metrics.error(resource);
                    relist = None;
                    current.clear();
                    Step::View(BTreeMap::new())
                }
                Err(e) => {
                    metrics.error(resource);
                    if let Some(code) = refusal(&e) {
                        metrics.set_refused(resource, true);
                        if !warned {
                            let why = if code == 401 {
                                "its credentials (an expired, revoked or wrong token: the ServiceAccount token or the kubeconfig's user)"
                            } else {
                                "access (RBAC: the Role bound to its ServiceAccount must grant list and watch)"
                            };
                            tracing::error!(
                                resource,
                                code,
                                error = %e,
                                "the Kubernetes API server refuses kvepp {why}; retrying with backoff (until it syncs, kvepp is not ready; after, it routes on the last view it had)"
                            );
                            warned = true;
                        }
                    } else if !warned {
                        tracing::warn!(resource, error = %e, "watch failed; retrying with backoff");
                        warned = true;
                    } else {
                        tracing::debug!(resource, error = %e, "watch failed again");
                    }
                    Step::Nothing
                }
            };
            match step {
                Step::View(v) => Some(v),
                Step::Nothing => None,
            }
        })
        .filter_map(std::future::ready)
}

/// The status code when the API server refused the request itself (401 Unauthorized, 403
/// Forbidden), not the watch's content.
fn refusal(e: &watcher::Error) -> Option<u16> {
    let code = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code,
        watcher::Error::WatchError(s) => s.code,
        _ => return None,
    };
    matches!(code, 401 | 403).then_some(code)
}

fn is_not_found(e: &watcher::Error) -> bool {
    matches!(e, watcher::Error::InitialListFailed(kube::Error::Api(s)) if s.code == 404)
}

/// [`ServiceDiscovery`] on EndpointSlices.
#[derive(Clone)]
pub struct KubeDiscovery {
    client: kube::Client,
    metrics: WatchMetrics,
}

impl std::fmt::Debug for KubeDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeDiscovery").finish_non_exhaustive()
    }
}

impl KubeDiscovery {
    pub fn new(client: kube::Client, metrics: WatchMetrics) -> Self {
        KubeDiscovery { client, metrics }
    }

    fn api(&self, namespace: &str) -> Api<k8s::EndpointSlice> {
        Api::namespaced(self.client.clone(), namespace)
    }
}

fn selector(component: &str) -> String {
    format!("{SERVICE_NAME_LABEL}={component}")
}

impl ServiceDiscovery for KubeDiscovery {
    fn list_instances<'a>(
        &'a self,
        namespace: &'a str,
        component: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async move {
            let list = self
                .api(namespace)
                .list(&ListParams::default().labels(&selector(component)))
                .await
                .map_err(|e| DiscoveryError::Kube(e.to_string()))?;
            let slices: Vec<EndpointSlice> = list.items.into_iter().map(from_k8s).collect();
            Ok(instances_from_slices(&slices).into_values().collect())
        })
    }

    fn watch(&self, namespace: &str, component: &str) -> InstanceStream {
        let cfg = watcher::Config::default().labels(&selector(component));
        let stream = watcher::watcher(self.api(namespace), cfg).default_backoff();
        let slices = views(stream, "endpointslices", false, self.metrics.clone(), |s| {
            let s = from_k8s(s);
            Some((s.metadata.name.clone(), s))
        });
        events_from_views(slices.map(|v| instances_from_slices(v.values())))
    }
}

/// The fields kvepp uses, from the typed object.
pub(crate) fn from_k8s(s: k8s::EndpointSlice) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: s.metadata.name.unwrap_or_default(),
            namespace: s.metadata.namespace,
            labels: s.metadata.labels.unwrap_or_default(),
            creation_timestamp: None,
        },
        address_type: Some(s.address_type),
        endpoints: s
            .endpoints
            .into_iter()
            .map(|e| SliceEndpoint {
                addresses: e.addresses,
                conditions: e
                    .conditions
                    .map(|c| Conditions {
                        ready: c.ready,
                        serving: c.serving,
                        terminating: c.terminating,
                    })
                    .unwrap_or_default(),
                target_ref: e.target_ref.map(|r| ObjectReference {
                    kind: r.kind,
                    name: r.name,
                    namespace: r.namespace,
                }),
                zone: e.zone,
                node_name: e.node_name,
            })
            .collect(),
        ports: s.ports.map(|ps| {
            ps.into_iter()
                .map(|p| SlicePort {
                    name: p.name,
                    port: p.port,
                })
                .collect()
        }),
    }
}

/// The inference CRDs kvepp watches: (group/version, kind, plural, metric name).
const CRDS: [(&str, &str, &str, &str, &str); 6] = [
    (
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "InferencePool",
        "inferencepools",
        "inferencepools.v1alpha2",
    ),
    (
        "inference.networking.k8s.io",
        "v1",
        "InferencePool",
        "inferencepools",
        "inferencepools.v1",
    ),
    (
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "InferenceModel",
        "inferencemodels",
        "inferencemodels.v1alpha2",
    ),
    (
        "llm-d.ai",
        "v1alpha2",
        "InferenceObjective",
        "inferenceobjectives",
        "inferenceobjectives.llm-d.v1alpha2",
    ),
    (
        "llm-d.ai",
        "v1alpha2",
        "InferenceModelRewrite",
        "inferencemodelrewrites",
        "inferencemodelrewrites.llm-d.v1alpha2",
    ),
    (
        "inference.networking.x-k8s.io",
        "v1alpha2",
        "InferenceModelRewrite",
        "inferencemodelrewrites",
        "inferencemodelrewrites.v1alpha2",
    ),
];

/// Watches the pool's InferencePools, InferenceModels, InferenceObjectives and
/// InferenceModelRewrites and feeds the datastore's catalog.
pub struct KubeCatalog {
    pub client: kube::Client,
    pub namespace: String,
    pub metrics: WatchMetrics,
    /// Called for every object that is not a valid InferencePool/InferenceModel.
    pub on_invalid: Box<dyn Fn() + Send + Sync>,
}

impl KubeCatalog {
    /// Runs until `shutdown`. The first catalog is applied once every kind has synced.
    pub(crate) async fn run(self, store: Arc<Datastore>, mut shutdown: watch::Receiver<bool>) {
        let on_invalid: Arc<dyn Fn() + Send + Sync> = Arc::from(self.on_invalid);
        let mut merged = futures::stream::SelectAll::new();
        for (i, (group, version, kind, plural, metric)) in CRDS.into_iter().enumerate() {
            let gvk = GroupVersionKind::gvk(group, version, kind);
            let ar = ApiResource::from_gvk_with_plural(&gvk, plural);
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &self.namespace, &ar);
            let stream =
                kube::runtime::watcher::watcher(api, watcher::Config::default()).default_backoff();
            let invalid = on_invalid.clone();
            let api_version = ar.api_version.clone();
            let view = views(
                stream,
                metric,
                true,
                self.metrics.clone(),
                move |obj: DynamicObject| {
                    let name = obj.metadata.name.clone().unwrap_or_default();
                    match convert(obj, &api_version, kind) {
                        Ok(o) => Some((name, o)),
                        Err(e) => {
                            tracing::warn!(kind, name, error = %e, "ignoring invalid object");
                            invalid();
                            None
                        }
                    }
                },
            );
            merged.push(view.map(move |v| (i, v)).boxed());
        }
        let mut kinds: [Option<BTreeMap<String, Object>>; CRDS.len()] = Default::default();
        loop {
            let next = tokio::select! {
                n = merged.next() => n,
                _ = shutdown.changed() => return,
            };
            let Some((i, view)) = next else { return };
            kinds[i] = Some(view);
            if kinds.iter().all(Option::is_some) {
                let objects: Vec<Object> = kinds
                    .iter()
                    .flatten()
                    .flat_map(|m| m.values().cloned())
                    .collect();
                store.apply_catalog(&objects);
            }
        }
    }
}

fn convert(obj: DynamicObject, api_version: &str, kind: &str) -> Result<Object, String> {
    let mut v = serde_json::to_value(&obj).map_err(|e| e.to_string())?;
    // List items may omit their type; the watch says what it is.
    v["apiVersion"] = api_version.into();
    v["kind"] = kind.into();
    let v: serde_yaml::Value = serde_yaml::to_value(v).map_err(|e| e.to_string())?;
    objects::from_value(v)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("unexpected kind {kind}"))
}

/// The server side inside a pod: the instance is the pod, identified by the Downward API.
#[derive(Debug, Clone)]
pub struct KubeRegistry {
    /// Downward API file of the pod's labels (`key="value"` lines).
    pub labels_file: PathBuf,
    pub pod_name: String,
    pub pod_namespace: String,
}

/// Parses the Downward API labels file format: `key="value"` per line, Go-quoted.
pub(crate) fn parse_downward_labels(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once('=')?;
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v);
            Some((
                k.trim().to_owned(),
                v.replace("\\\"", "\"").replace("\\\\", "\\"),
            ))
        })
        .collect()
}

impl ServiceRegistry for KubeRegistry {
    fn register_instance(
        &self,
        namespace: &str,
        component: &str,
    ) -> Result<InstanceHandle, RegistryError> {
        let fail = |m: String| Err(RegistryError::Labels(m));
        if self.pod_name.is_empty() {
            return fail("the pod's name is unknown: set POD_NAME from the Downward API (fieldRef metadata.name)".into());
        }
        if self.pod_namespace != namespace {
            return fail(format!(
                "the pod runs in namespace {:?} but registers in {namespace:?} (POD_NAMESPACE from the Downward API, fieldRef metadata.namespace)",
                self.pod_namespace
            ));
        }
        let text = std::fs::read_to_string(&self.labels_file).map_err(|e| {
            RegistryError::Labels(format!(
                "cannot read the pod's labels at {} ({e}): mount them with a downwardAPI volume (fieldRef metadata.labels)",
                self.labels_file.display()
            ))
        })?;
        let labels = parse_downward_labels(&text);
        match labels.get(COMPONENT_LABEL) {
            Some(c) if c == component => {}
            Some(c) => {
                return fail(format!(
                    "the pod's label {COMPONENT_LABEL}={c:?} does not match component {component:?}"
                ))
            }
            None => {
                return fail(format!(
                    "the pod has no label {COMPONENT_LABEL}: the component's Service selects on it, so the pod would never be discovered"
                ))
            }
        }
        // Readiness reaches the EndpointSlice through the pod's readiness probe (`/health`).
        Ok(InstanceHandle::new(self.pod_name.as_str(), |_| {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downward_labels() {
        let l = parse_downward_labels(
            "app=\"vllm\"\nkvepp.io/component=\"pool\"\npod-template-hash=\"7d4\"\nq=\"a\\\"b\"\n",
        );
        assert_eq!(l["kvepp.io/component"], "pool");
        assert_eq!(l["q"], "a\"b");
        assert_eq!(l.len(), 4);
    }

    #[test]
    fn registry_checks_labels() {
        let dir = kvepp_test_support::TempDir::new("downward");
        let f = dir.path().join("labels");
        let reg = KubeRegistry {
            labels_file: f.clone(),
            pod_name: "pod-1".into(),
            pod_namespace: "ns".into(),
        };
        let err = reg.register_instance("ns", "pool").unwrap_err().to_string();
        assert!(err.contains("downwardAPI"), "{err}");
        std::fs::write(&f, "app=\"x\"\n").unwrap();
        let err = reg.register_instance("ns", "pool").unwrap_err().to_string();
        assert!(err.contains("no label kvepp.io/component"), "{err}");
        std::fs::write(&f, "kvepp.io/component=\"other\"\n").unwrap();
        assert!(reg.register_instance("ns", "pool").is_err());
        assert!(reg.register_instance("elsewhere", "other").is_err());
        std::fs::write(&f, "kvepp.io/component=\"pool\"\n").unwrap();
        let h = reg.register_instance("ns", "pool").unwrap();
        assert_eq!(h.instance_id(), "pod-1");
    }
}
