//! Live reconfiguration of `kvepp serve`: on SIGHUP, or when the `--config` file or a TLS file
//! changes (watched with `notify`), the tree is loaded again exactly as at start (file,
//! environment, flags; validated, one message per bad field) and what can change live is handed to
//! the components that run with it.
//!
//! Invariants: a tree that fails to load or validate (or names a tokenizer that fails to load)
//! changes nothing: the running configuration keeps serving, the reason is logged and
//! `kvepp_config_reloads_total{result="rejected"}` counts it. Fields only a restart applies keep
//! their value and are named in a warning ([`crate::config::live::merge`] says which). New settings
//! apply to requests that start afterwards; no stream is dropped. A certificate that fails to load
//! leaves the one in use serving (`kvepp_tls_reloads_total{result="rejected"}`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, watch};

use super::components::{self, load_tokenizer};
use super::tls::Acceptor;
use crate::admission::FlowControl;
use crate::config::live::{merge, Effective};
use crate::config::{Config, ConfigError, TlsMode, UnknownModels};
use crate::engine::metrics::ScrapeSettings;
use crate::extproc::Shared;
use crate::metrics::{Metrics, Register, ResultLabels};
use crate::process::LogLevel;
use crate::routing::service::Tokenizers;
use crate::routing::RequestRouter;
use kvepp_core::Router;

/// File events closer together than this are one change (an editor's write, a Secret's symlink
/// swap).
const SETTLE: Duration = Duration::from_millis(100);

/// How the running process reloads its configuration; given by the binary.
pub struct Reloading {
    /// Loads the tree again as at start: file, environment and flags, validated.
    pub load: Box<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>,
    /// The `--config` file (watched), if any.
    pub file: Option<PathBuf>,
    /// Reload on SIGHUP (the binary; never a test process).
    pub sighup: bool,
    /// The log filter's handle.
    pub log: Option<LogLevel>,
}

impl std::fmt::Debug for Reloading {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloading")
            .field("file", &self.file)
            .field("sighup", &self.sighup)
            .finish()
    }
}

/// `kvepp_config_reloads_total{result}` and `kvepp_tls_reloads_total{result}`.
#[derive(Debug, Clone, Default)]
pub struct ReloadMetrics {
    pub config: Family<ResultLabels, Counter>,
    pub tls: Family<ResultLabels, Counter>,
}

impl ReloadMetrics {
    fn count(family: &Family<ResultLabels, Counter>, result: &'static str) {
        family.get_or_create(&ResultLabels { result }).inc();
    }
}

impl Register for ReloadMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "config_reloads",
            "Configuration reloads (SIGHUP or a change of the --config file), by result: applied, unchanged, rejected (the running configuration kept)",
            self.config.clone(),
        );
        registry.register(
            "tls_reloads",
            "Re-reads of the ext_proc TLS certificate, key and client CA after they changed, by result: applied, rejected (the material in use kept)",
            self.tls.clone(),
        );
    }
}

/// The running components that take new settings.
pub(super) struct Live {
    pub effective: Arc<Effective>,
    pub router: Arc<Router>,
    pub routing: Arc<RequestRouter>,
    pub shared: Arc<Shared>,
    pub flow: Arc<FlowControl>,
    pub scrape: watch::Sender<ScrapeSettings>,
    pub acceptor: Acceptor,
    pub metrics: Arc<Metrics>,
    pub counters: ReloadMetrics,
}

impl Live {
    /// Loads the tree again and applies it; the outcome is logged and counted.
    async fn reload_config(&self, how: &Reloading, why: &'static str) {
        let (_, running) = self.effective.get();
        let new = match (how.load)() {
            Ok(c) => c,
            Err(e) => return self.rejected(why, &e),
        };
        let (merged, restart) = merge(&running, &new);
        if !restart.is_empty() {
            tracing::warn!(trigger = why, fields = ?restart, "these fields apply only at a restart; they keep their running value");
        }
        if merged == *running {
            tracing::info!(trigger = why, "configuration reloaded: nothing changed");
            ReloadMetrics::count(&self.counters.config, "unchanged");
            return;
        }
        let tokenizers = match self.tokenizers(&running, &merged).await {
            Ok(t) => t,
            Err(e) => return self.rejected(why, &e),
        };
        if let Some(log) = &how.log {
            match log.set(&merged.log_level) {
                Ok(true) => {}
                Ok(false) => tracing::info!("RUST_LOG is set: it keeps the log filter"),
                Err(e) => tracing::warn!(error = %e, "log_level not applied"),
            }
        }
        self.apply(&merged, tokenizers);
        let changed = crate::config::live::changed(&running, &merged);
        let version = self.effective.replace(merged);
        ReloadMetrics::count(&self.counters.config, "applied");
        tracing::info!(trigger = why, version, changed = ?changed, "configuration reloaded");
    }

    /// A reload that changes nothing: logged and counted.
    fn rejected(&self, why: &'static str, e: &dyn std::fmt::Display) {
        tracing::error!(trigger = why, error = %e, "configuration reload rejected; the running configuration stays in effect");
        ReloadMetrics::count(&self.counters.config, "rejected");
    }

    /// Hands the live settings of `cfg` to the running components.
    fn apply(&self, cfg: &Config, tokenizers: Option<Tokenizers>) {
        self.router
            .retune(cfg.router, components::tuning(cfg), &cfg.session_affinity);
        self.routing
            .set_pass_through_unknown(cfg.unknown_models == UnknownModels::PassThrough);
        if let Some(t) = tokenizers {
            self.routing.set_tokenizers(t);
        }
        self.shared.set_settings(components::extproc_settings(cfg));
        self.shared
            .affinity
            .set_header(Some(&cfg.session_affinity.header));
        self.flow.reconfigure(cfg.flow_control.clone());
        self.shared.limits.reconfigure(cfg.rate_limits.clone());
        self.scrape.send_replace(components::scrape_settings(cfg));
    }

    /// The tokenizers `new` names: those of `running` kept as they are, the others loaded (off
    /// the runtime's threads). None: the map did not change.
    async fn tokenizers(
        &self,
        running: &Config,
        new: &Config,
    ) -> Result<Option<Tokenizers>, super::ServerError> {
        if running.tokenizers == new.tokenizers {
            return Ok(None);
        }
        let current = self.routing.tokenizers();
        let mut out = Tokenizers::new();
        for (model, dir) in &new.tokenizers {
            if running.tokenizers.get(model) == Some(dir) {
                if let Some(t) = current.get(model) {
                    out.insert(model.clone(), t.clone());
                    continue;
                }
            }
            let (metrics, m, d) = (self.metrics.clone(), model.clone(), dir.clone());
            let t = tokio::task::spawn_blocking(move || load_tokenizer(&metrics, &m, &d))
                .await
                .map_err(|e| super::ServerError::Serve {
                    what: "tokenizer loading",
                    message: e.to_string(),
                })??;
            out.insert(model.clone(), t);
        }
        Ok(Some(out))
    }

    /// Reads the TLS files again (mode `files`); logged and counted.
    fn reload_tls(&self, why: &'static str) {
        let (_, cfg) = self.effective.get();
        match self.acceptor.reload(&cfg.grpc_tls) {
            Ok(false) => {}
            Ok(true) => {
                ReloadMetrics::count(&self.counters.tls, "applied");
                tracing::info!(
                    trigger = why,
                    "ext_proc TLS material reloaded; new connections use it"
                );
            }
            Err(e) => {
                ReloadMetrics::count(&self.counters.tls, "rejected");
                tracing::error!(trigger = why, error = %e, "ext_proc TLS reload failed; the certificate in use keeps serving");
            }
        }
    }
}

/// The files whose change triggers a reload, with a digest of what they held when last read.
struct Watched {
    config: Option<(PathBuf, u64)>,
    tls: Vec<PathBuf>,
    tls_digest: u64,
}

fn digest(paths: &[&Path]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for p in paths {
        h.update(&std::fs::read(p).unwrap_or_default());
        h.update(&[0xff]);
    }
    h.digest()
}

impl Watched {
    fn new(file: Option<&Path>, cfg: &Config) -> Self {
        let tls: Vec<PathBuf> = match cfg.grpc_tls.mode {
            TlsMode::Files => [
                &cfg.grpc_tls.cert_file,
                &cfg.grpc_tls.key_file,
                &cfg.grpc_tls.client_ca_file,
            ]
            .into_iter()
            .flatten()
            .cloned()
            .collect(),
            _ => Vec::new(),
        };
        let mut w = Watched {
            config: file.map(|f| (f.to_owned(), digest(&[f]))),
            tls,
            tls_digest: 0,
        };
        w.tls_digest = w.tls_now();
        w
    }

    /// The digest of the TLS files' contents now.
    fn tls_now(&self) -> u64 {
        digest(&self.tls.iter().map(PathBuf::as_path).collect::<Vec<_>>())
    }

    /// The directories to watch: a file's own directory, since editors and Kubernetes replace
    /// files (a ConfigMap or Secret mount swaps a symlink) rather than write them in place.
    fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = self
            .config
            .iter()
            .map(|(p, _)| p)
            .chain(&self.tls)
            .map(|p| match p.parent() {
                Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
                _ => PathBuf::from("."),
            })
            .collect();
        dirs.sort();
        dirs.dedup();
        dirs
    }

    /// Which of the watched contents changed since last asked: (config, tls).
    fn changed(&mut self) -> (bool, bool) {
        let config = match &mut self.config {
            Some((p, d)) => {
                let now = digest(&[p.as_path()]);
                std::mem::replace(d, now) != now
            }
            None => false,
        };
        let now = self.tls_now();
        let tls = std::mem::replace(&mut self.tls_digest, now) != now;
        (config, tls)
    }
}

/// A watcher sending one message per burst of events in `dirs` (None: none could be set up,
/// logged; SIGHUP still works).
fn watch_dirs(dirs: &[PathBuf]) -> Option<(notify::RecommendedWatcher, mpsc::Receiver<()>)> {
    use notify::Watcher;
    if dirs.is_empty() {
        return None;
    }
    let (tx, rx) = mpsc::channel(1);
    let watcher = notify::recommended_watcher(move |_: notify::Result<notify::Event>| {
        // Full: a wake-up is pending already.
        let _ = tx.try_send(());
    });
    let mut watcher = match watcher {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the configuration files; reload with SIGHUP");
            return None;
        }
    };
    for d in dirs {
        if let Err(e) = watcher.watch(d, notify::RecursiveMode::NonRecursive) {
            tracing::warn!(dir = %d.display(), error = %e, "cannot watch this directory; reload with SIGHUP");
        }
    }
    Some((watcher, rx))
}

/// Reloads on SIGHUP and on changes of the watched files until `stop` turns true.
pub(super) async fn run(live: Arc<Live>, how: Reloading, mut stop: watch::Receiver<bool>) {
    let (_, cfg) = live.effective.get();
    let mut watched = Watched::new(how.file.as_deref(), &cfg);
    let (_watcher, mut events) = match watch_dirs(&watched.dirs()) {
        Some((w, rx)) => (Some(w), Some(rx)),
        None => (None, None),
    };
    let mut hup = if how.sighup {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP");
                None
            }
        }
    } else {
        None
    };
    loop {
        let hangup = async {
            match &mut hup {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        let event = async {
            match &mut events {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(()) = hangup => {
                tracing::info!("SIGHUP received: reloading the configuration");
                watched.changed();
                live.reload_config(&how, "SIGHUP").await;
                live.reload_tls("SIGHUP");
            }
            Some(()) = event => {
                // Let the burst settle (a write in several parts, a symlink swap), then read.
                tokio::time::sleep(SETTLE).await;
                if let Some(rx) = &mut events {
                    while rx.try_recv().is_ok() {}
                }
                let (config, tls) = watched.changed();
                if config {
                    live.reload_config(&how, "file changed").await;
                }
                if tls {
                    live.reload_tls("file changed");
                }
            }
            _ = stop.changed() => return,
        }
    }
}
