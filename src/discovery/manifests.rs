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

use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::objects::{parse_documents, Object};
use super::{Datastore, DiscoverySource, Inventory};

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
    pub fn new(
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
        }
    }

    /// Re-reads the directory. Returns the inventory when anything changed.
    pub fn poll_once(&mut self) -> Option<Inventory> {
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

impl DiscoverySource for ManifestDir {
    fn spawn(
        mut self: Box<Self>,
        store: Arc<Datastore>,
        mut shutdown: watch::Receiver<bool>,
    ) -> JoinHandle<()> {
        // The first read happens before spawning returns, so the pool is known as soon as possible.
        store.apply(&self.poll_once().unwrap_or_default());
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
                    store.apply(&inv);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const POOL: &str = "apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\nmetadata: {name: p}\nspec: {targetPortNumber: 8000}\n";

    #[test]
    fn last_good_kept_per_file() {
        let dir = crate::testing::TempDir::new("manifests");
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
}
