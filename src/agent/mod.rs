//! The worker-agent (`kvepp-agent`, also `kvepp worker-agent`): the registry's server side, run as a sidecar beside vLLM or SGLang.
//!
//! At start it registers the pod as an instance of `(namespace, component)` — with the Kubernetes
//! registry that checks the Downward API labels and fails clearly when the Service could never
//! select the pod. It then serves, on one HTTP port (the EndpointSlice port named `metadata`):
//! - `GET /metadata`: the instance's metadata in the selector's schema
//!   ([`crate::engine::metadata::EngineMetadata`]), from `--metadata-file` (re-read when it
//!   changes) overlaid with flags;
//! - `GET /health`: the pod's readiness probe: 200 only while the engine's own health endpoint
//!   answers 200 and the instance is set ready; 503 otherwise (the kubelet applies the probe's
//!   own `failureThreshold`). A failing probe is what takes the pod out of its EndpointSlices.
//!
//! The readiness the agent publishes itself (what a manifests-registry slice says) follows the
//! engine: it checks the engine every `--check-interval-ms` and marks the instance unready after
//! `--failure-threshold` consecutive failed checks (3 by default, as a Kubernetes probe's
//! `failureThreshold`: one slow answer under load does not take the pod out), ready again after
//! one success.
//!
//! With `DYN_TOPOLOGY_ENABLED=true` the agent first reads the pod's topology levels from the
//! Downward API volume ([`topology`]), waiting for the level the router constrains KV transfers to
//! (`DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL`) and exiting with an error naming its file when it never
//! appears; the levels are published as `topology_domains`. Without `--role`, the role comes from
//! the pod label `--role-label` (Downward API labels file).
//!
//! On SIGTERM the instance is set unready at once (the probe fails, the EPP stops routing to it)
//! and the agent keeps serving for `--drain-seconds` so in-flight requests finish.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;

use crate::discovery::kubernetes::KubeRegistry;
use crate::discovery::service::{Instance, InstanceHandle, RegistryError, ServiceRegistry};
use crate::discovery::ManifestRegistry;
use crate::engine::metadata::{EngineMetadata, KvEventsInfo, ModelInfo, RuntimeConfig};

/// How often the topology level's Downward API file is looked for while the agent waits for it
/// (the kubelet writes it within a second or two of the pod starting).
const TOPOLOGY_POLL: Duration = Duration::from_millis(500);

/// The longest an engine health check may take: the check interval when shorter, so a hung
/// engine is seen as down within one interval, and never more than 2 s.
const HEALTH_TIMEOUT_MAX: Duration = Duration::from_secs(2);

/// The most of an engine's health answer read (a health page is a few bytes; this bounds a
/// misbehaving one).
const HEALTH_PAGE_BYTES: usize = 64 << 10;

pub(crate) mod topology;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RegistryKind {
    /// The pod itself (Downward API labels; readiness through the probe on `/health`).
    Kubernetes,
    /// An EndpointSlice file in `--manifests-dir` (local runs without a cluster).
    Manifests,
}

/// Flags of `kvepp worker-agent` (and `kvepp-agent`). With `--config FILE`, the file's
/// `worker_agent` section gives the flags by name, under the environment and the command line
/// (`crate::config::agent`).
#[derive(Debug, Clone, clap::Args)]
pub struct AgentArgs {
    /// Configuration file (YAML or JSON): its `worker_agent` section, the flags by name.
    #[arg(long, env = "KVEPP_CONFIG")]
    pub config: Option<PathBuf>,
    /// Kubernetes namespace the instance registers in (the pod's own, from the Downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// The component: the Service that selects this pod (label `kvepp.io/component`). Required
    /// (here or in the `--config` file).
    #[arg(long, env = "KVEPP_COMPONENT", default_value = "")]
    pub component: String,
    /// Where the pod registers: the Kubernetes API (its EndpointSlice readiness) or a manifests directory.
    #[arg(long, value_enum, default_value = "kubernetes")]
    pub registry: RegistryKind,
    /// Address of the `/metadata` and `/health` server.
    #[arg(long, default_value = "0.0.0.0:8090")]
    pub listen: SocketAddr,
    /// The engine's own health endpoint.
    #[arg(long, default_value = "http://127.0.0.1:8000/health")]
    pub engine_health_url: String,
    /// The engine's serving port (the EndpointSlice `http` port; manifests registry only).
    #[arg(long, default_value_t = 8000)]
    pub engine_port: u16,
    /// Metadata document (JSON or YAML, `/metadata` schema); re-read when it changes.
    #[arg(long)]
    pub metadata_file: Option<PathBuf>,
    /// Served model name.
    #[arg(long)]
    pub model_name: Option<String>,
    /// Tokens per KV block (`--block-size` of the engine).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// KV blocks the engine holds (`/metadata` capacity; the cost model's memory).
    #[arg(long)]
    pub total_kv_blocks: Option<u64>,
    /// Most sequences the engine runs at once (`--max-num-seqs`).
    #[arg(long)]
    pub max_num_seqs: Option<u64>,
    /// Most tokens the engine batches in one step (`--max-num-batched-tokens`).
    #[arg(long)]
    pub max_num_batched_tokens: Option<u64>,
    /// Data-parallel ranks; rank r publishes KV events on `--kv-events-port` + r.
    #[arg(long)]
    pub data_parallel_size: Option<u32>,
    /// Port of the engine's KV-event publisher (`--kv-events-config` endpoint `tcp://*:PORT`).
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// Port of the publisher's replay endpoint.
    #[arg(long)]
    pub kv_events_replay_port: Option<u16>,
    /// `prefill`, `decode` or `both`.
    #[arg(long)]
    pub role: Option<String>,
    /// Topology domains, `key=value` (repeatable), e.g. `zone=us-east-1a`; override the files.
    #[arg(long = "topology", value_parser = parse_kv)]
    pub topology: Vec<(String, String)>,
    /// Read the topology levels from `--topology-dir` at start (the operator sets it).
    #[arg(long, env = "DYN_TOPOLOGY_ENABLED", default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", value_parser = clap::builder::BoolishValueParser::new())]
    pub topology_enabled: bool,
    /// The Downward API volume with one file per topology level.
    #[arg(
        long,
        env = "DYN_TOPOLOGY_DIR",
        default_value = "/etc/podinfo/topology"
    )]
    pub topology_dir: PathBuf,
    /// The level the router keeps KV transfers within: its file must appear, or the agent exits.
    #[arg(long, env = "DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL")]
    pub topology_level: Option<String>,
    /// How long to wait for that level's file, in seconds.
    #[arg(long, env = "DYN_TOPOLOGY_WAIT_SECONDS", default_value_t = 60)]
    pub topology_wait_seconds: u64,
    /// Pod label holding the role when `--role` is not given (read from `--labels-file`).
    #[arg(long, default_value = "llm-d.ai/role")]
    pub role_label: String,
    /// Levels read from `--topology-dir` at start (not a flag).
    #[arg(skip)]
    pub topology_from_files: topology::Domains,
    /// The pod's name: the instance id.
    #[arg(long, env = "POD_NAME", default_value = "")]
    pub pod_name: String,
    /// The pod's IP (what the KV-event endpoints and a manifests slice advertise).
    #[arg(long, env = "POD_IP", default_value = "127.0.0.1")]
    pub pod_ip: IpAddr,
    /// Downward API file with the pod's labels.
    #[arg(long, default_value = "/etc/podinfo/labels")]
    pub labels_file: PathBuf,
    /// Manifests directory of the manifests registry.
    #[arg(long)]
    pub manifests_dir: Option<PathBuf>,
    /// How often the engine's health and the metadata file are checked, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub check_interval_ms: u64,
    /// Consecutive failed engine health checks before the instance is unready (as a Kubernetes
    /// probe's `failureThreshold`); one success makes it ready again. At least 1.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub failure_threshold: u32,
    /// After SIGTERM: unready at once, keep serving this long.
    #[arg(long, default_value_t = 5)]
    pub drain_seconds: u64,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not key=value"))
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot register: {0}")]
    Register(#[from] RegistryError),
    #[error("--engine-health-url {0:?}: expected http://host:port/path")]
    HealthUrl(String),
    #[error("--registry manifests needs --manifests-dir")]
    NoManifestsDir,
    #[error("--component is required (or worker_agent.component in the --config file)")]
    NoComponent,
    #[error("metadata file {path}: {message}")]
    MetadataFile { path: PathBuf, message: String },
    #[error("HTTP server: {0}")]
    Serve(std::io::Error),
    #[error(transparent)]
    Topology(#[from] topology::MissingLevel),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

impl AgentArgs {
    fn registry(&self) -> Result<Box<dyn ServiceRegistry>, AgentError> {
        Ok(match self.registry {
            RegistryKind::Kubernetes => Box::new(KubeRegistry {
                labels_file: self.labels_file.clone(),
                pod_name: self.pod_name.clone(),
                pod_namespace: self.namespace.clone(),
            }),
            RegistryKind::Manifests => Box::new(ManifestRegistry {
                dir: self
                    .manifests_dir
                    .clone()
                    .ok_or(AgentError::NoManifestsDir)?,
                instance: Instance {
                    id: if self.pod_name.is_empty() {
                        format!("{}-{}", self.component, self.listen.port()).into()
                    } else {
                        self.pod_name.as_str().into()
                    },
                    ip: self.pod_ip,
                    port: Some(self.engine_port),
                    metadata_port: Some(self.listen.port()),
                    zone: self
                        .topology
                        .iter()
                        .find(|(k, _)| k == "zone")
                        .map(|(_, v)| v.as_str().into()),
                    node: None,
                },
            }),
        })
    }

    /// The file's document (or the empty one) with the flags laid over it.
    pub(crate) fn metadata(&self, file: Option<EngineMetadata>) -> EngineMetadata {
        let mut md = file.unwrap_or_default();
        let model = md.model.get_or_insert_with(ModelInfo::default);
        overlay(&mut model.name, &self.model_name);
        let rc = model
            .runtime_config
            .get_or_insert_with(RuntimeConfig::default);
        overlay(&mut rc.block_size, &self.block_size);
        overlay(&mut rc.total_kv_blocks, &self.total_kv_blocks);
        overlay(&mut rc.max_num_seqs, &self.max_num_seqs);
        overlay(&mut rc.max_num_batched_tokens, &self.max_num_batched_tokens);
        overlay(&mut rc.data_parallel_size, &self.data_parallel_size);
        if *rc == RuntimeConfig::default() {
            model.runtime_config = None;
        }
        if *model == ModelInfo::default() {
            md.model = None;
        }
        if let Some(port) = self.kv_events_port {
            let ranks = self.data_parallel_size.unwrap_or(1).max(1);
            let endpoints = |base: u16| -> BTreeMap<String, String> {
                (0..ranks)
                    .filter_map(|r| {
                        let p = base.checked_add(u16::try_from(r).ok()?)?;
                        Some((
                            r.to_string(),
                            format!("tcp://{}", SocketAddr::new(self.pod_ip, p)),
                        ))
                    })
                    .collect()
            };
            md.kv_events = Some(KvEventsInfo {
                endpoints: endpoints(port),
                replay_endpoints: self
                    .kv_events_replay_port
                    .map(endpoints)
                    .unwrap_or_default(),
            });
        }
        // The file document, then the Downward API levels, then the flags.
        for (k, v) in self
            .topology_from_files
            .iter()
            .chain(self.topology.iter().map(|(k, v)| (k, v)))
        {
            md.topology_domains.insert(k.clone(), v.clone());
        }
        overlay(&mut md.role, &self.role);
        md
    }
}

impl AgentArgs {
    /// The pod's topology (Downward API files, when enabled) and, without `--role`, its role
    /// label.
    async fn discover_place(&mut self) -> Result<(), AgentError> {
        if self.topology_enabled {
            let level = self.topology_level.as_deref().filter(|l| !l.is_empty());
            let dir = self.topology_dir.clone();
            self.topology_from_files = topology::wait_for_level(
                &dir,
                level,
                Duration::from_secs(self.topology_wait_seconds),
                TOPOLOGY_POLL,
                |n| {
                    if n == 1 {
                        tracing::info!(dir = %dir.display(), level, "waiting for the topology level's file");
                    }
                },
            )
            .await?;
            tracing::info!(domains = ?self.topology_from_files, "topology read from the Downward API volume");
        }
        if self.role.is_none() {
            if let Ok(text) = std::fs::read_to_string(&self.labels_file) {
                let labels = crate::discovery::kubernetes::parse_downward_labels(&text);
                if let Some(role) = labels.get(&self.role_label) {
                    tracing::info!(role = %role, label = %self.role_label, "role from the pod label");
                    self.role = Some(role.clone());
                }
            }
        }
        Ok(())
    }
}

/// A flag that was given replaces the file's value.
fn overlay<T: Clone>(dst: &mut Option<T>, flag: &Option<T>) {
    if flag.is_some() {
        dst.clone_from(flag);
    }
}

fn read_metadata_file(path: &Path) -> Result<EngineMetadata, AgentError> {
    let err = |message: String| AgentError::MetadataFile {
        path: path.into(),
        message,
    };
    let text = std::fs::read(path).map_err(|e| err(e.to_string()))?;
    // YAML is a superset of JSON: one parser reads both.
    serde_yaml::from_slice(&text).map_err(|e| err(e.to_string()))
}

#[derive(Clone)]
struct AgentState {
    handle: InstanceHandle,
    intent: Arc<AtomicBool>,
    engine: Arc<EngineHealth>,
}

#[derive(Debug)]
struct EngineHealth {
    host: String,
    port: u16,
    path: String,
    timeout: Duration,
}

impl EngineHealth {
    fn parse(url: &str, timeout: Duration) -> Result<Self, AgentError> {
        let bad = || AgentError::HealthUrl(url.to_owned());
        let uri: axum::http::Uri = url.parse().map_err(|_| bad())?;
        if uri.scheme_str() != Some("http") {
            return Err(bad());
        }
        Ok(EngineHealth {
            host: uri
                .host()
                .ok_or_else(bad)?
                .trim_matches(['[', ']'])
                .to_owned(),
            port: uri.port_u16().unwrap_or(80),
            path: uri.path_and_query().map_or("/".into(), |p| p.to_string()),
            timeout,
        })
    }

    async fn check(&self) -> Result<(), String> {
        let addr = tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("resolve {}: {e}", self.host))?
            .next()
            .ok_or_else(|| format!("{} has no address", self.host))?;
        crate::engine::get(addr, &self.path, self.timeout, HEALTH_PAGE_BYTES)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// The sidecar process: logging, `--listen` bound, [`run`] until SIGTERM/SIGINT (both `kvepp-agent`
/// and `kvepp worker-agent` call this).
pub async fn main(args: AgentArgs) -> Result<(), AgentError> {
    crate::process::init_logging(crate::process::LogFormat::Text, "info", None);
    let addr = args.listen;
    let l = TcpListener::bind(addr)
        .await
        .map_err(|source| AgentError::Bind { addr, source })?;
    run(args, l, crate::process::shutdown_signal()).await
}

/// Registers, serves `/metadata` and `/health` on `listener`, keeps both current, until `shutdown`
/// completes; then unready, and serving for `drain`.
pub async fn run(
    mut args: AgentArgs,
    listener: TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    if args.component.is_empty() {
        return Err(AgentError::NoComponent);
    }
    args.discover_place().await?;
    let interval = Duration::from_millis(args.check_interval_ms.max(10));
    let engine = Arc::new(EngineHealth::parse(
        &args.engine_health_url,
        interval.min(HEALTH_TIMEOUT_MAX),
    )?);
    let file_doc = match &args.metadata_file {
        Some(p) => Some(read_metadata_file(p)?),
        None => None,
    };
    let handle = args
        .registry()?
        .register_instance(&args.namespace, &args.component)?;
    tracing::info!(instance = handle.instance_id(), namespace = %args.namespace, component = %args.component, "instance registered");
    let mut last_file = file_doc.clone();
    handle.set_metadata(args.metadata(file_doc));
    let state = AgentState {
        handle: handle.clone(),
        intent: Arc::new(AtomicBool::new(true)),
        engine: engine.clone(),
    };
    let app = Router::new()
        .route("/metadata", get(metadata))
        .route("/health", get(health))
        .with_state(state.clone());
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .into_future(),
    );
    // The check loop: the engine's health and the instance's intent make the published readiness
    // (what a manifests slice says); the metadata file is re-read when it changes.
    let checker = {
        let state = state.clone();
        let args = args.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut warned = false;
            let mut health = Health::new(args.failure_threshold);
            loop {
                tick.tick().await;
                let check = state.engine.check().await;
                match &check {
                    Ok(()) => warned = false,
                    Err(e) if !warned => {
                        tracing::warn!(error = %e, "engine not healthy");
                        warned = true;
                    }
                    Err(_) => {}
                }
                let engine_ok = health.observe(check.is_ok());
                let ready = engine_ok && state.intent.load(Ordering::SeqCst);
                if state.handle.published().ready != ready {
                    tracing::info!(ready, "instance readiness changed");
                    state.handle.set_ready(ready);
                }
                if let Some(p) = &args.metadata_file {
                    match read_metadata_file(p) {
                        Ok(doc) if Some(&doc) != last_file.as_ref() => {
                            tracing::info!(file = %p.display(), "metadata file changed");
                            state.handle.set_metadata(args.metadata(Some(doc.clone())));
                            last_file = Some(doc);
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::debug!(error = %e, "metadata file unreadable; keeping the last good")
                        }
                    }
                }
            }
        })
    };
    shutdown.await;
    tracing::info!(
        drain_seconds = args.drain_seconds,
        "draining: instance unready"
    );
    state.intent.store(false, Ordering::SeqCst);
    handle.set_ready(false);
    tokio::time::sleep(Duration::from_secs(args.drain_seconds)).await;
    checker.abort();
    let _ = stop_tx.send(true);
    match server.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(AgentError::Serve(e)),
        Err(e) => Err(AgentError::Serve(std::io::Error::other(e.to_string()))),
    }
}

async fn metadata(State(st): State<AgentState>) -> impl IntoResponse {
    let md = st.handle.published().metadata;
    match serde_json::to_vec(&*md) {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            e.to_string().into_bytes(),
        ),
    }
}

/// The engine's health as the published readiness follows it: down after `threshold`
/// consecutive failed checks (a Kubernetes probe's `failureThreshold`), up again after one
/// success, and not up before its first success.
#[derive(Debug)]
struct Health {
    threshold: u32,
    failures: u32,
    up: bool,
}

impl Health {
    fn new(threshold: u32) -> Self {
        Health {
            threshold: threshold.max(1),
            failures: 0,
            up: false,
        }
    }

    /// One check's result; returns whether the engine counts as healthy now.
    fn observe(&mut self, ok: bool) -> bool {
        if ok {
            self.failures = 0;
            self.up = true;
        } else {
            self.failures = self.failures.saturating_add(1);
            if self.failures >= self.threshold {
                self.up = false;
            }
        }
        self.up
    }
}

async fn health(State(st): State<AgentState>) -> impl IntoResponse {
    if !st.intent.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: draining\n".to_string(),
        );
    }
    match st.engine.check().await {
        Ok(()) => (StatusCode::OK, "ok\n".to_string()),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: engine health: {e}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn health_goes_down_after_the_failure_threshold_and_up_after_one_success() {
        let mut h = Health::new(3);
        assert!(!h.observe(false), "never up before a first success");
        assert!(h.observe(true));
        assert!(
            h.observe(false) && h.observe(false),
            "two failures are tolerated"
        );
        assert!(!h.observe(false), "the third is not");
        assert!(!h.observe(false));
        assert!(h.observe(true), "one success brings it back");
        assert!(h.observe(false), "and the count starts over");
        let mut strict = Health::new(1);
        assert!(strict.observe(true) && !strict.observe(false));
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: AgentArgs,
    }

    fn args(extra: &[&str]) -> AgentArgs {
        let mut v = vec!["x", "--component", "pool"];
        v.extend_from_slice(extra);
        Cli::parse_from(v).a
    }

    #[test]
    fn flags_over_file() {
        let a = args(&[
            "--model-name",
            "m",
            "--block-size",
            "16",
            "--data-parallel-size",
            "2",
            "--kv-events-port",
            "5557",
            "--kv-events-replay-port",
            "5600",
            "--topology",
            "zone=z1",
            "--role",
            "decode",
            "--pod-ip",
            "10.1.2.3",
        ]);
        let file: EngineMetadata = serde_json::from_str(
            r#"{"model": {"name": "from-file", "type": "Completions", "runtime_config": {"total_kv_blocks": 100, "block_size": 32}}, "role": "both"}"#,
        )
        .unwrap();
        let md = a.metadata(Some(file));
        let json = serde_json::to_value(&md).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "model": {"name": "m", "type": "Completions",
                          "runtime_config": {"block_size": 16, "total_kv_blocks": 100, "data_parallel_size": 2}},
                "kv_events": {"endpoints": {"0": "tcp://10.1.2.3:5557", "1": "tcp://10.1.2.3:5558"},
                              "replay_endpoints": {"0": "tcp://10.1.2.3:5600", "1": "tcp://10.1.2.3:5601"}},
                "topology_domains": {"zone": "z1"},
                "role": "decode"
            })
        );
        // What the agent serves is what the selector reads.
        let back = EngineMetadata::parse(&serde_json::to_vec(&md).unwrap()).unwrap();
        assert_eq!(back, md);
        assert_eq!(back.kv_event_sources().len(), 2);
        assert_eq!(args(&[]).metadata(None), EngineMetadata::default());
    }

    #[test]
    fn bad_inputs() {
        assert!(EngineHealth::parse("https://x/health", Duration::from_secs(1)).is_err());
        assert!(EngineHealth::parse("not a url", Duration::from_secs(1)).is_err());
        let h =
            EngineHealth::parse("http://[::1]:8000/health?x=1", Duration::from_secs(1)).unwrap();
        assert_eq!(
            (h.host.as_str(), h.port, h.path.as_str()),
            ("::1", 8000, "/health?x=1")
        );
        assert!(parse_kv("=x").is_err());
        assert!(args(&["--registry", "manifests"]).registry().is_err());
    }
}
