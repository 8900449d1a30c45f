//! The "local/file system" discovery backend: a directory of Kubernetes YAML manifests.
//!
//! The directory is polled (default every 250 ms) rather than watched with inotify: polling also
//! follows Kubernetes ConfigMap volumes (which swap a symlink) and editors that replace files, and a
//! few small files cost nothing to re-read. Each file is applied all or nothing: a file that fails to
//! parse is logged once per content and its last good objects are kept.

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::WatchStream;

use super::objects::{parse_documents, Object, SERVICE_NAME_LABEL};
use super::service::{
    events_from_views, ready_in_objects, DiscoveryError, Instance, InstanceHandle, InstanceStream,
    Published, RegistryError, ServiceDiscovery, ServiceRegistry,
};
use super::{Datastore, Inventory};

#[derive(Debug)]
struct FileState {
    content_hash: u64,
    /// Objects from the last version of the file that parsed.
    good: Vec<Object>,
}

/// Polls a directory of `*.yaml`, `*.yml` and `*.json` files.
pub struct ManifestDir {
    dir: PathBuf,
    poll: Duration,
    files: BTreeMap<PathBuf, FileState>,
    dir_error_logged: bool,
    on_error: Arc<dyn Fn(&Path) + Send + Sync>,
    /// The last inventory, for [`ManifestDiscovery`] watchers (`None` before the first read).
    published: watch::Sender<Option<Arc<Inventory>>>,
}

impl std::fmt::Debug for ManifestDir {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManifestDir")
            .field("dir", &self.dir)
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

impl ManifestDir {
    /// `on_error` is called for every file version that fails to parse (metrics hook).
    pub(crate) fn new(
        dir: impl Into<PathBuf>,
        poll: Duration,
        on_error: impl Fn(&Path) + Send + Sync + 'static,
    ) -> Self {
        ManifestDir {
            dir: dir.into(),
            poll,
            files: BTreeMap::new(),
            dir_error_logged: false,
            on_error: Arc::new(on_error),
            published: watch::channel(None).0,
        }
    }

    /// The [`ServiceDiscovery`] view of this directory's EndpointSlices (fed once spawned).
    pub(crate) fn discovery(&self) -> ManifestDiscovery {
        ManifestDiscovery {
            inventory: self.published.subscribe(),
        }
    }

    /// Re-reads the directory. Returns the inventory when anything changed.
    pub(crate) fn poll_once(&mut self) -> Option<Inventory> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => {
                self.dir_error_logged = false;
                e
            }
            Err(err) => {
                if !self.dir_error_logged {
                    tracing::error!(dir = %self.dir.display(), %err, "cannot read manifests directory; keeping the last good state");
                    self.dir_error_logged = true;
                }
                return None;
            }
        };
        let mut seen: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                matches!(
                    p.extension().and_then(|e| e.to_str()),
                    Some("yaml" | "yml" | "json")
                )
            })
            .filter(|p| {
                !p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with('.'))
            })
            .collect();
        seen.sort();
        let mut changed = false;
        let before = self.files.len();
        self.files.retain(|p, _| seen.contains(p));
        if self.files.len() != before {
            changed = true;
        }
        for path in seen {
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            let mut h = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut h);
            let content_hash = h.finish();
            if self
                .files
                .get(&path)
                .is_some_and(|f| f.content_hash == content_hash)
            {
                continue;
            }
            match parse_documents(&bytes) {
                Ok(objects) => {
                    tracing::info!(file = %path.display(), objects = objects.len(), "manifest loaded");
                    self.files.insert(
                        path,
                        FileState {
                            content_hash,
                            good: objects,
                        },
                    );
                    changed = true;
                }
                Err(err) => {
                    tracing::error!(file = %path.display(), %err, "manifest rejected; keeping its last good version");
                    (self.on_error)(&path);
                    let good = self.files.remove(&path).map(|f| f.good).unwrap_or_default();
                    self.files.insert(path, FileState { content_hash, good });
                }
            }
        }
        changed.then(|| Inventory {
            objects: self
                .files
                .values()
                .flat_map(|f| f.good.iter().cloned())
                .collect(),
        })
    }
}

impl ManifestDir {
    /// Reads the directory now, then every poll interval until `shutdown`: the catalog goes to
    /// `store`, the slices to [`ManifestDir::discovery`] watchers.
    pub(crate) fn spawn(
        mut self,
        store: Arc<Datastore>,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        // The first read happens before spawning returns, so the pool is known as soon as possible.
        let first = self.poll_once().unwrap_or_default();
        store.apply_catalog(&first.objects);
        self.published.send_replace(Some(Arc::new(first)));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(self.poll);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.changed() => return,
                }
                // File reads are small and rare; a blocking read on the runtime is acceptable here.
                if let Some(inv) = self.poll_once() {
                    store.apply_catalog(&inv.objects);
                    self.published.send_replace(Some(Arc::new(inv)));
                }
            }
        })
    }
}

/// [`ServiceDiscovery`] over the EndpointSlices of a [`ManifestDir`].
#[derive(Debug, Clone)]
pub struct ManifestDiscovery {
    inventory: watch::Receiver<Option<Arc<Inventory>>>,
}

impl ServiceDiscovery for ManifestDiscovery {
    fn list_instances<'a>(
        &'a self,
        namespace: &'a str,
        component: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Instance>, DiscoveryError>> {
        let inv = self.inventory.borrow().clone();
        Box::pin(async move {
            let inv = inv.ok_or_else(|| {
                DiscoveryError::Unavailable("manifests directory not read yet".into())
            })?;
            Ok(ready_in_objects(&inv.objects, namespace, component)
                .into_values()
                .collect())
        })
    }

    fn watch(&self, namespace: &str, component: &str) -> InstanceStream {
        let (ns, comp) = (namespace.to_owned(), component.to_owned());
        events_from_views(
            WatchStream::new(self.inventory.clone())
                .filter_map(std::future::ready)
                .map(move |inv| ready_in_objects(&inv.objects, &ns, &comp)),
        )
    }
}

/// The local [`ServiceRegistry`]: an instance is an EndpointSlice file in the manifests directory
/// (`endpointslice-<component>-<id>.yaml`), rewritten atomically on every change, as the
/// endpoints controller would on a readiness change.
#[derive(Debug, Clone)]
pub struct ManifestRegistry {
    pub dir: PathBuf,
    /// Id, address and ports of the instance this process is.
    pub instance: Instance,
}

impl ManifestRegistry {
    fn write(
        dir: &Path,
        namespace: &str,
        component: &str,
        inst: &Instance,
        ready: bool,
    ) -> std::io::Result<()> {
        let mut ports = Vec::new();
        if let Some(p) = inst.port {
            ports.push(serde_json::json!({"name": "http", "port": p, "protocol": "TCP"}));
        }
        if let Some(p) = inst.metadata_port {
            ports.push(serde_json::json!({"name": super::service::METADATA_PORT_NAME, "port": p, "protocol": "TCP"}));
        }
        let slice = serde_json::json!({
            "apiVersion": super::objects::DISCOVERY_V1,
            "kind": "EndpointSlice",
            "metadata": {
                "name": format!("{component}-{}", inst.id),
                "namespace": namespace,
                "labels": {SERVICE_NAME_LABEL: component},
            },
            "addressType": if inst.ip.is_ipv4() { "IPv4" } else { "IPv6" },
            "endpoints": [{
                "addresses": [inst.ip.to_string()],
                "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": &*inst.id, "namespace": namespace},
                "zone": inst.zone.as_deref(),
                "nodeName": inst.node.as_deref(),
            }],
            "ports": ports,
        });
        let file = dir.join(format!("endpointslice-{component}-{}.yaml", inst.id));
        let tmp = dir.join(format!(".endpointslice-{component}-{}.tmp", inst.id));
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(&slice).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, &file)
    }
}

impl ServiceRegistry for ManifestRegistry {
    fn register_instance(
        &self,
        namespace: &str,
        component: &str,
    ) -> Result<InstanceHandle, RegistryError> {
        let io = |e: std::io::Error| RegistryError::Io(format!("{}: {e}", self.dir.display()));
        Self::write(&self.dir, namespace, component, &self.instance, false).map_err(io)?;
        let (dir, ns, comp, inst) = (
            self.dir.clone(),
            namespace.to_owned(),
            component.to_owned(),
            self.instance.clone(),
        );
        Ok(InstanceHandle::new(
            self.instance.id.clone(),
            move |p: &Published| {
                if let Err(e) = Self::write(&dir, &ns, &comp, &inst, p.ready) {
                    tracing::error!(dir = %dir.display(), error = %e, "cannot write the instance's EndpointSlice");
                }
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const POOL: &str = "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\nmetadata: {name: p}\nspec: {targetPortNumber: 8000}\n";

    #[test]
    fn last_good_kept_per_file() {
        let dir = kvepp_test_support::TempDir::new("manifests");
        let errors = Arc::new(AtomicUsize::new(0));
        let e = errors.clone();
        let mut md = ManifestDir::new(dir.path(), Duration::from_millis(10), move |_| {
            e.fetch_add(1, Ordering::SeqCst);
        });
        assert!(
            md.poll_once().is_none(),
            "an empty directory is the empty state"
        );
        std::fs::write(dir.path().join("pool.yaml"), POOL).unwrap();
        std::fs::write(dir.path().join("notes.txt"), "ignored").unwrap();
        assert_eq!(md.poll_once().unwrap().objects.len(), 1);
        assert!(md.poll_once().is_none(), "no change, no update");
        std::fs::write(dir.path().join("pool.yaml"), "kind: [broken").unwrap();
        assert!(md.poll_once().is_none(), "a broken file changes nothing");
        assert!(md.poll_once().is_none(), "and is reported once");
        assert_eq!(errors.load(Ordering::SeqCst), 1);
        std::fs::write(dir.path().join("pool.yaml"), POOL.replace("p}", "q}")).unwrap();
        let inv = md.poll_once().unwrap();
        assert!(matches!(&inv.objects[0], Object::Pool(p) if p.name == "q"));
        std::fs::remove_file(dir.path().join("pool.yaml")).unwrap();
        assert!(
            md.poll_once().unwrap().objects.is_empty(),
            "deleting the file removes its objects"
        );
    }

    #[tokio::test]
    async fn registry_files_are_discovered() {
        use crate::discovery::service::InstanceEvent;
        let dir = kvepp_test_support::TempDir::new("manifest-registry");
        std::fs::write(dir.path().join("pool.yaml"), POOL).unwrap();
        let inst = Instance {
            id: "pod-1".into(),
            ip: [127, 0, 0, 9].into(),
            port: Some(8000),
            metadata_port: Some(8090),
            zone: Some("z".into()),
            node: None,
        };
        let reg = ManifestRegistry {
            dir: dir.path().into(),
            instance: inst.clone(),
        };
        let handle = reg.register_instance("default", "p").unwrap();
        let md = ManifestDir::new(dir.path(), Duration::from_millis(10), |_| {});
        let disc = md.discovery();
        let store = Arc::new(Datastore::new(
            super::super::PoolRef {
                name: "p".into(),
                namespace: "default".into(),
                service: "p".into(),
                picker_service: None,
            },
            |_| {},
        ));
        let (_stop_tx, stop) = watch::channel(false);
        let _task = md.spawn(store.clone(), stop);
        let mut w = disc.watch("default", "p");
        use crate::discovery::service::next_event as next;
        assert_eq!(
            next(&mut w).await,
            InstanceEvent::Synced,
            "registered, not ready"
        );
        handle.set_ready(true);
        assert_eq!(next(&mut w).await, InstanceEvent::Added(inst.clone()));
        assert_eq!(disc.list_instances("default", "p").await.unwrap(), [inst]);
        handle.set_ready(false);
        assert_eq!(next(&mut w).await, InstanceEvent::Removed("pod-1".into()));
    }
}
