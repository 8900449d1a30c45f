//! The in-memory discovery backend: registry and discovery in one process (tests, embedding).
//! An instance is listed once registered and ready, as a pod is once its readiness probe passes.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::StreamExt;
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;

use super::service::{
    events_from_views, DiscoveryError, Instance, InstanceHandle, InstanceStream, RegistryError,
    ServiceDiscovery, ServiceRegistry,
};

type Key = (String, String);

#[derive(Debug, Default)]
struct Entry {
    instance: Option<Instance>,
    ready: bool,
}

#[derive(Debug, Default)]
struct Inner {
    /// (namespace, component) → id → entry.
    entries: Mutex<BTreeMap<Key, BTreeMap<Arc<str>, Entry>>>,
}

/// Shared in-memory registry; clones see the same instances.
#[derive(Debug, Clone)]
pub struct MemoryDiscovery {
    inner: Arc<Inner>,
    version: watch::Sender<u64>,
}

impl Default for MemoryDiscovery {
    fn default() -> Self {
        MemoryDiscovery {
            inner: Arc::default(),
            version: watch::channel(0).0,
        }
    }
}

impl MemoryDiscovery {
    /// A registry whose registrations are this instance (its id, address and ports).
    pub fn registrar(&self, instance: Instance) -> MemoryRegistrar {
        MemoryRegistrar {
            discovery: self.clone(),
            instance,
        }
    }

    fn ready_set(&self, namespace: &str, component: &str) -> BTreeMap<Arc<str>, Instance> {
        let entries = self.inner.entries.lock();
        entries
            .get(&(namespace.to_owned(), component.to_owned()))
            .into_iter()
            .flatten()
            .filter(|(_, e)| e.ready)
            .filter_map(|(id, e)| Some((id.clone(), e.instance.clone()?)))
            .collect()
    }

    fn set(&self, key: &Key, id: &Arc<str>, f: impl FnOnce(&mut Entry)) {
        {
            let mut entries = self.inner.entries.lock();
            f(entries
                .entry(key.clone())
                .or_default()
                .entry(id.clone())
                .or_default());
        }
        self.version.send_modify(|v| *v += 1);
    }
}

impl ServiceDiscovery for MemoryDiscovery {
    fn list_instances<'a>(
        &'a self,
        namespace: &'a str,
        component: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Instance>, DiscoveryError>> {
        Box::pin(async move { Ok(self.ready_set(namespace, component).into_values().collect()) })
    }

    fn watch(&self, namespace: &str, component: &str) -> InstanceStream {
        let this = self.clone();
        let (ns, comp) = (namespace.to_owned(), component.to_owned());
        events_from_views(
            WatchStream::new(self.version.subscribe()).map(move |_| this.ready_set(&ns, &comp)),
        )
    }
}

/// [`ServiceRegistry`] of one in-memory instance.
#[derive(Debug, Clone)]
pub struct MemoryRegistrar {
    discovery: MemoryDiscovery,
    instance: Instance,
}

impl ServiceRegistry for MemoryRegistrar {
    fn register_instance(
        &self,
        namespace: &str,
        component: &str,
    ) -> Result<InstanceHandle, RegistryError> {
        let key: Key = (namespace.to_owned(), component.to_owned());
        let id = self.instance.id.clone();
        let inst = self.instance.clone();
        self.discovery.set(&key, &id, |e| e.instance = Some(inst));
        let d = self.discovery.clone();
        let hid = id.clone();
        Ok(InstanceHandle::new(id, move |p| {
            let ready = p.ready;
            d.set(&key, &hid, |e| e.ready = ready)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::service::{next_event as next, InstanceEvent};

    fn inst(id: &str, last: u8) -> Instance {
        Instance {
            id: id.into(),
            ip: [10, 0, 0, last].into(),
            port: Some(8000),
            metadata_port: None,
            zone: None,
            node: None,
        }
    }

    #[tokio::test]
    async fn register_ready_unready() {
        let d = MemoryDiscovery::default();
        let a = d
            .registrar(inst("a", 1))
            .register_instance("ns", "c")
            .unwrap();
        let mut w = d.watch("ns", "c");
        assert_eq!(
            next(&mut w).await,
            InstanceEvent::Synced,
            "registered but not ready: empty"
        );
        a.set_ready(true);
        assert_eq!(next(&mut w).await, InstanceEvent::Added(inst("a", 1)));
        let b = d
            .registrar(inst("b", 2))
            .register_instance("ns", "c")
            .unwrap();
        let other = d
            .registrar(inst("z", 9))
            .register_instance("ns", "other")
            .unwrap();
        other.set_ready(true);
        b.set_ready(true);
        assert_eq!(next(&mut w).await, InstanceEvent::Added(inst("b", 2)));
        let listed = d.list_instances("ns", "c").await.unwrap();
        assert_eq!(listed, [inst("a", 1), inst("b", 2)]);
        a.set_ready(false);
        assert_eq!(next(&mut w).await, InstanceEvent::Removed("a".into()));
        // A late watcher gets the current set, then Synced.
        let mut late = d.watch("ns", "c");
        assert_eq!(next(&mut late).await, InstanceEvent::Added(inst("b", 2)));
        assert_eq!(next(&mut late).await, InstanceEvent::Synced);
    }
}
