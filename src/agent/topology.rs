//! The worker's topology, from the Downward API volume the operator mounts when
//! `DYN_TOPOLOGY_ENABLED=true`: one file per topology level (`/etc/podinfo/topology/zone` holding
//! `us-east-1a`, ...), projected from the pod's topology labels.
//!
//! Invariants: only regular files with a non-empty value count (the Downward API's `..data`
//! bookkeeping entries are skipped); a required level that never appears within the wait is an
//! error naming its file, which makes the agent exit non-zero rather than serve a worker the
//! router would have to exclude.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Topology domains: level → value.
pub type Domains = BTreeMap<String, String>;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("topology level {level:?} not found: {} has no value after {}s (DYN_TOPOLOGY_ENABLED=true; mount the Downward API volume that projects the pod's topology labels, see manifests/)", .file.display(), .waited.as_secs())]
pub struct MissingLevel {
    pub level: String,
    pub file: PathBuf,
    pub waited: Duration,
}

/// Every level in `dir`: file name → trimmed contents (unreadable or empty files are skipped;
/// a missing directory reads as no levels).
pub(crate) fn read_dir(dir: &Path) -> Domains {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Domains::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if name.starts_with('.') || !e.path().is_file() {
                return None;
            }
            let value = std::fs::read_to_string(e.path()).ok()?.trim().to_owned();
            (!value.is_empty()).then_some((name, value))
        })
        .collect()
}

/// Reads `dir` until `required` (when given) has a value, for at most `wait`, re-reading every
/// `every`; `on_miss` runs after each read that lacks it (logging; tests use it to make the file
/// appear late).
pub(crate) async fn wait_for_level(
    dir: &Path,
    required: Option<&str>,
    wait: Duration,
    every: Duration,
    mut on_miss: impl FnMut(u32),
) -> Result<Domains, MissingLevel> {
    let start = Instant::now();
    let mut misses = 0u32;
    loop {
        let domains = read_dir(dir);
        let Some(level) = required else {
            return Ok(domains);
        };
        if domains.contains_key(level) {
            return Ok(domains);
        }
        if start.elapsed() >= wait {
            return Err(MissingLevel {
                level: level.to_owned(),
                file: dir.join(level),
                waited: wait,
            });
        }
        misses += 1;
        on_miss(misses);
        tokio::time::sleep(every.min(wait.saturating_sub(start.elapsed()))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvepp_test_support::TempDir;

    const LONG: Duration = Duration::from_secs(60);
    const TICK: Duration = Duration::from_millis(5);

    #[tokio::test]
    async fn files_present() {
        let dir = TempDir::new("topology");
        std::fs::write(dir.path().join("zone"), "us-east-1a\n").unwrap();
        std::fs::write(dir.path().join("rack"), "rack-01").unwrap();
        std::fs::write(dir.path().join("empty"), "  \n").unwrap();
        std::fs::create_dir(dir.path().join("..data")).unwrap();
        let d = wait_for_level(dir.path(), Some("zone"), LONG, TICK, |_| {
            panic!("no miss expected")
        })
        .await
        .unwrap();
        assert_eq!(
            d,
            Domains::from([
                ("rack".into(), "rack-01".into()),
                ("zone".into(), "us-east-1a".into())
            ])
        );
        // No required level: whatever is there, at once.
        let none = TempDir::new("topology-none");
        assert!(
            wait_for_level(none.path(), None, LONG, TICK, |_| panic!("no wait"))
                .await
                .unwrap()
                .is_empty()
        );
    }

    #[tokio::test]
    async fn a_level_that_appears_late_is_waited_for() {
        let dir = TempDir::new("topology-late");
        let zone = dir.path().join("zone");
        let mut seen = 0;
        let d = wait_for_level(dir.path(), Some("zone"), LONG, TICK, |n| {
            seen = n;
            // The projection lands after the worker's third look.
            if n == 3 {
                std::fs::write(&zone, "z2").unwrap();
            }
        })
        .await
        .unwrap();
        assert_eq!(seen, 3);
        assert_eq!(d["zone"], "z2");
    }

    #[tokio::test]
    async fn a_level_that_never_appears_names_its_file() {
        let dir = TempDir::new("topology-missing");
        std::fs::write(dir.path().join("rack"), "r1").unwrap();
        let err = wait_for_level(dir.path(), Some("zone"), Duration::ZERO, TICK, |_| {})
            .await
            .unwrap_err();
        assert_eq!(err.file, dir.path().join("zone"));
        assert!(err
            .to_string()
            .contains(&dir.path().join("zone").display().to_string()));
    }
}
