//! The single typed configuration of `kvepp serve`.
//!
//! Precedence, lowest to highest: built-in defaults → the `--config` file (YAML or JSON, unknown
//! fields rejected) → environment variables → command-line flags. Every field is validated at
//! startup and each bad field gets its own message; the effective configuration is logged once.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use kvepp_core::cost::{CostWeights, KnobError};
use kvepp_core::KvSettings;

use crate::engine::metadata::FetchSettings;
pub use crate::engine::metrics::EngineMetricsConfig;
pub use crate::kv_events::KvEventsConfig;
pub use crate::process::LogFormat;
pub use crate::replica::ReplicaSyncConfig;

/// What to do with a request whose model matches no InferenceModel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum UnknownModels {
    /// 404, as the EPP protocol requires.
    Reject,
    /// Route it with Standard criticality and no rewrite (newer reference EPPs).
    PassThrough,
}

/// Which picker ranks the candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum PickerKind {
    /// KV-cache overlap and active load, Dynamo's cost (the default).
    KvAware,
    /// KV-aware cost, but the prefix is only what kvepp itself routed to each endpoint (no KV
    /// events; what the reference EPP's prefix-cache scorer does).
    ApproximatePrefix,
    /// Least in-flight requests only.
    LeastLoaded,
    /// Each request to the next endpoint in turn (a plain Kubernetes Service).
    RoundRobin,
}

/// Where the ext_proc port's TLS certificate comes from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// A self-signed certificate generated at each start (the reference EPP's default); the proxy
    /// encrypts but does not verify it.
    #[default]
    SelfSigned,
    /// `cert_file` and `key_file` (PEM), e.g. a mounted cert-manager Secret.
    Files,
    /// Plaintext HTTP/2 (h2c).
    Off,
}

/// TLS of the ext_proc gRPC port. The gRPC health port stays plaintext (kubelet's gRPC probes
/// cannot speak TLS) and binds `admin_bind_address`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTls {
    pub mode: TlsMode,
    /// PEM certificate chain (mode `files`).
    pub cert_file: Option<PathBuf>,
    /// PEM private key (mode `files`).
    pub key_file: Option<PathBuf>,
    /// PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS; needs
    /// `accept_plaintext: false`).
    pub client_ca_file: Option<PathBuf>,
    /// Also serve plaintext HTTP/2 (h2c) on the same port, told apart from TLS by the first byte,
    /// so proxies configured for h2c keep working; `false` refuses them.
    pub accept_plaintext: bool,
}

impl Default for GrpcTls {
    fn default() -> Self {
        GrpcTls {
            mode: TlsMode::SelfSigned,
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            accept_plaintext: true,
        }
    }
}

impl GrpcTls {
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let file = |name: &str, f: &Option<PathBuf>, out: &mut Vec<String>| match f {
            Some(p) if !p.is_file() => out.push(format!("{name} {} is not a file", p.display())),
            _ => {}
        };
        match self.mode {
            TlsMode::Files => {
                if self.cert_file.is_none() || self.key_file.is_none() {
                    out.push("mode files needs cert_file and key_file".into());
                }
                file("cert_file", &self.cert_file, &mut out);
                file("key_file", &self.key_file, &mut out);
            }
            TlsMode::SelfSigned | TlsMode::Off => {
                if self.cert_file.is_some() || self.key_file.is_some() {
                    out.push(format!(
                        "cert_file and key_file are only read in mode files (mode is {})",
                        serde_json::to_string(&self.mode).unwrap_or_default()
                    ));
                }
            }
        }
        if self.mode == TlsMode::Off && self.client_ca_file.is_some() {
            out.push("client_ca_file needs TLS (mode self-signed or files)".into());
        }
        if self.client_ca_file.is_some() && self.accept_plaintext {
            out.push(
                "client_ca_file makes client certificates mandatory: set accept_plaintext: false"
                    .into(),
            );
        }
        if self.mode == TlsMode::Off && !self.accept_plaintext {
            out.push("mode off serves plaintext only: accept_plaintext must be true".into());
        }
        file("client_ca_file", &self.client_ca_file, &mut out);
        out
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// ext_proc gRPC port.
    pub grpc_port: u16,
    /// gRPC health port (services `liveness`, `readiness`, `envoy.service.ext_proc.v3.ExternalProcessor`).
    pub grpc_health_port: u16,
    /// Prometheus `/metrics` (and HTTP `/health`, `/ready`) port.
    pub metrics_port: u16,
    /// Address the ext_proc port binds (the proxy must reach it).
    pub bind_address: IpAddr,
    /// Address the gRPC health, metrics/debug and HTTP service ports bind: loopback unless told
    /// otherwise (`0.0.0.0` for kubelet probes and Prometheus in a pod; see the manifests).
    pub admin_bind_address: IpAddr,
    /// TLS of the ext_proc port (self-signed by default).
    pub grpc_tls: GrpcTls,
    /// File holding the bearer token that `/debug/*` and the HTTP services' write routes require;
    /// unset: no token (keep those ports on loopback or behind a NetworkPolicy).
    pub api_token_file: Option<PathBuf>,
    /// Opens the Dynamo-compatible selection service (`kvepp select-service`'s routes) on this
    /// port over the ext_proc picker's own state; unset: closed. Needs a KV-aware picker.
    pub select_service_port: Option<u16>,
    /// Opens the Dynamo-compatible slot tracker (`kvepp slot-tracker`'s routes) on this port over
    /// the ext_proc picker's own state; unset: closed. Needs a KV-aware picker.
    pub slot_tracker_port: Option<u16>,
    /// InferencePool this EPP serves.
    pub pool_name: String,
    pub pool_namespace: String,
    /// Service whose EndpointSlices list the pool's endpoints; defaults to the pool name.
    pub endpoint_service: Option<String>,
    /// Directory of Kubernetes manifests used instead of a cluster. Unset: the Kubernetes API.
    pub manifests_dir: Option<PathBuf>,
    /// Kubeconfig file for the Kubernetes API. Unset: `KUBECONFIG`, `~/.kube/config`, then the
    /// in-cluster service account, as every Kubernetes tool does.
    pub kubeconfig: Option<PathBuf>,
    /// How often the manifests directory is re-read, in milliseconds.
    pub manifests_poll_ms: u64,
    pub unknown_models: UnknownModels,
    /// Send `primary,fallback` in the destination header and metadata (ordered-list form).
    pub destination_endpoint_list: bool,
    /// Send every candidate's score with the pick: header and `envoy.lb` metadata key
    /// `x-gateway-destination-endpoint-scores` (llm-d's `--emit-endpoint-scores`).
    pub emit_endpoint_scores: bool,
    /// kvepp's own Service: an InferencePool whose `endpointPickerRef` (v1) or `extensionRef`
    /// (v1alpha2) names another Service is logged and not served. Unset: not checked.
    pub endpoint_picker_service: Option<String>,
    /// Queue requests that find every endpoint saturated, by priority (InferenceObjective).
    pub flow_control: crate::request::FlowControlSettings,
    /// In-flight requests at which an endpoint is saturated (Sheddable requests get 429 when every
    /// eligible endpoint is); 0 disables shedding.
    pub max_in_flight_per_endpoint: u32,
    /// Largest request body kvepp accepts (413 above it).
    pub max_body_bytes: usize,
    /// Grace period for open streams on SIGTERM, in seconds.
    pub shutdown_grace_seconds: u64,
    /// How long an ext_proc stream waits for the pool to be loaded after a start before it is
    /// answered 503, in milliseconds (0: answer at once).
    pub startup_wait_ms: u64,
    pub log_format: LogFormat,
    /// tracing filter, e.g. `info` or `kvepp=debug`.
    pub log_level: String,
    pub picker: PickerKind,
    /// Tokens per KV block, as the engines are configured (`--block-size`); unset: learned from the
    /// engines' `vllm:cache_config_info` (the core's default, 16, until then).
    pub block_size: Option<u32>,
    pub engine_metrics: EngineMetricsConfig,
    /// Fetching each endpoint's `/metadata` (block size, model, KV-event sockets).
    pub engine_metadata: FetchSettings,
    /// The KV-aware cost knobs; the `DYN_ROUTER_*` environment variables override the file.
    pub router: CostWeights,
    pub kv_events: KvEventsConfig,
    /// Active-active replicas: share picks, releases and (approximate mode) routed prefixes with
    /// the other kvepp replicas over ZMQ.
    pub replica_sync: ReplicaSyncConfig,
    /// Approximate prefix mode (no tokenizer): blocks remembered per endpoint.
    pub approx_blocks_per_endpoint: usize,
    /// Served model name → directory with its HuggingFace `tokenizer.json` (and
    /// `tokenizer_config.json` for the chat template). Models without one use approximate
    /// prefix matching.
    pub tokenizers: std::collections::BTreeMap<String, PathBuf>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            grpc_port: 9002,
            grpc_health_port: 9003,
            metrics_port: 9090,
            bind_address: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            admin_bind_address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            grpc_tls: GrpcTls::default(),
            api_token_file: None,
            select_service_port: None,
            slot_tracker_port: None,
            pool_name: String::new(),
            pool_namespace: "default".into(),
            endpoint_service: None,
            manifests_dir: None,
            kubeconfig: None,
            manifests_poll_ms: 250,
            unknown_models: UnknownModels::Reject,
            destination_endpoint_list: false,
            emit_endpoint_scores: false,
            endpoint_picker_service: None,
            flow_control: Default::default(),
            max_in_flight_per_endpoint: 128,
            max_body_bytes: 8 << 20,
            shutdown_grace_seconds: 25,
            startup_wait_ms: 5_000,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            picker: PickerKind::KvAware,
            block_size: None,
            engine_metrics: EngineMetricsConfig::default(),
            engine_metadata: FetchSettings::default(),
            router: CostWeights::default(),
            kv_events: KvEventsConfig::default(),
            replica_sync: ReplicaSyncConfig::default(),
            approx_blocks_per_endpoint: KvSettings::default().approx_blocks_per_endpoint,
            tokenizers: Default::default(),
        }
    }
}

/// One bad field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("invalid configuration:\n{}", .0.iter().map(|e| format!("  - {e}")).collect::<Vec<_>>().join("\n"))]
    Invalid(Vec<FieldError>),
}

/// Flags (and their environment variables) of `kvepp serve`. Every flag overrides the file.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ServeArgs {
    /// Configuration file (YAML or JSON); flags and environment variables override it.
    #[arg(long, env = "KVEPP_CONFIG")]
    pub config: Option<PathBuf>,
    #[arg(long, env = "KVEPP_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    #[arg(long, env = "KVEPP_GRPC_HEALTH_PORT")]
    pub grpc_health_port: Option<u16>,
    #[arg(long, env = "KVEPP_METRICS_PORT")]
    pub metrics_port: Option<u16>,
    /// Address the ext_proc port binds.
    #[arg(long, env = "KVEPP_BIND_ADDRESS")]
    pub bind_address: Option<String>,
    /// Address the health, metrics/debug and HTTP service ports bind (default 127.0.0.1).
    #[arg(long, env = "KVEPP_ADMIN_BIND_ADDRESS")]
    pub admin_bind_address: Option<String>,
    /// TLS of the ext_proc port: self-signed (default), files, or off.
    #[arg(long, env = "KVEPP_GRPC_TLS_MODE", value_enum)]
    pub grpc_tls_mode: Option<TlsMode>,
    #[arg(long, env = "KVEPP_GRPC_TLS_CERT_FILE")]
    pub grpc_tls_cert_file: Option<PathBuf>,
    #[arg(long, env = "KVEPP_GRPC_TLS_KEY_FILE")]
    pub grpc_tls_key_file: Option<PathBuf>,
    /// CA bundle for client certificates (mutual TLS).
    #[arg(long, env = "KVEPP_GRPC_TLS_CLIENT_CA_FILE")]
    pub grpc_tls_client_ca_file: Option<PathBuf>,
    /// Also accept plaintext h2c on the TLS port (default true).
    #[arg(long, env = "KVEPP_GRPC_TLS_ACCEPT_PLAINTEXT")]
    pub grpc_tls_accept_plaintext: Option<bool>,
    /// Bearer token file for /debug/* and the HTTP services' write routes.
    #[arg(long, env = "KVEPP_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
    /// Serve the selection service's HTTP routes on this port over the picker's state.
    #[arg(long, env = "KVEPP_SELECT_SERVICE_PORT")]
    pub select_service_port: Option<u16>,
    /// Serve the slot tracker's HTTP routes on this port over the picker's state.
    #[arg(long, env = "KVEPP_SLOT_TRACKER_PORT")]
    pub slot_tracker_port: Option<u16>,
    #[arg(long, env = "KVEPP_POOL_NAME")]
    pub pool_name: Option<String>,
    #[arg(long, env = "KVEPP_POOL_NAMESPACE")]
    pub pool_namespace: Option<String>,
    /// Service whose EndpointSlices belong to the pool (default: the pool name).
    #[arg(long, env = "KVEPP_ENDPOINT_SERVICE")]
    pub endpoint_service: Option<String>,
    /// Read InferencePool/InferenceModel/EndpointSlice objects from this directory instead of the
    /// Kubernetes API.
    #[arg(long, env = "KVEPP_MANIFESTS_DIR")]
    pub manifests_dir: Option<PathBuf>,
    /// Kubeconfig for the Kubernetes API (default: KUBECONFIG, ~/.kube/config, in-cluster).
    #[arg(long, env = "KVEPP_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    #[arg(long, env = "KVEPP_MANIFESTS_POLL_MS")]
    pub manifests_poll_ms: Option<u64>,
    #[arg(long, env = "KVEPP_UNKNOWN_MODELS", value_enum)]
    pub unknown_models: Option<UnknownModels>,
    /// Ordered-list form `primary,fallback` in the destination header and metadata.
    #[arg(long, env = "KVEPP_DESTINATION_ENDPOINT_LIST")]
    pub destination_endpoint_list: Option<bool>,
    #[arg(long, env = "KVEPP_MAX_IN_FLIGHT_PER_ENDPOINT")]
    pub max_in_flight_per_endpoint: Option<u32>,
    /// Send every candidate's score in x-gateway-destination-endpoint-scores.
    #[arg(long, env = "KVEPP_EMIT_ENDPOINT_SCORES")]
    pub emit_endpoint_scores: Option<bool>,
    /// kvepp's own Service name: pools whose picker reference names another are not served.
    #[arg(long, env = "KVEPP_ENDPOINT_PICKER_SERVICE")]
    pub endpoint_picker_service: Option<String>,
    /// Queue requests that find every endpoint saturated (flow_control.enabled).
    #[arg(long, env = "KVEPP_FLOW_CONTROL")]
    pub flow_control: Option<bool>,
    /// Longest wait in the flow-control queue before a 503 (flow_control.max_wait_ms).
    #[arg(long, env = "KVEPP_FLOW_CONTROL_MAX_WAIT_MS")]
    pub flow_control_max_wait_ms: Option<u64>,
    #[arg(long, env = "KVEPP_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    #[arg(long, env = "KVEPP_SHUTDOWN_GRACE_SECONDS")]
    pub shutdown_grace_seconds: Option<u64>,
    #[arg(long, env = "KVEPP_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    #[arg(long, env = "KVEPP_LOG_LEVEL")]
    pub log_level: Option<String>,
    #[arg(long, env = "KVEPP_PICKER", value_enum)]
    pub picker: Option<PickerKind>,
    #[arg(long, env = "KVEPP_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Subscribe to the endpoints' KV events at `tcp://<address>:<kv-events-port>`.
    #[arg(long, env = "KVEPP_KV_EVENTS_ENABLED")]
    pub kv_events_enabled: Option<bool>,
    #[arg(long, env = "KVEPP_KV_EVENTS_PORT")]
    pub kv_events_port: Option<u16>,
    #[arg(long, env = "KVEPP_KV_EVENTS_REPLAY_PORT")]
    pub kv_events_replay_port: Option<u16>,
    /// Replica sync: ZMQ PUB endpoint to bind (e.g. tcp://*:9094).
    #[arg(long, env = "KVEPP_REPLICA_SYNC_BIND")]
    pub replica_sync_bind: Option<String>,
    /// Replica sync: this replica's endpoint as its peers reach it.
    #[arg(long, env = "KVEPP_REPLICA_SYNC_ADVERTISE")]
    pub replica_sync_advertise: Option<String>,
    /// Replica sync: comma-separated peer PUB endpoints.
    #[arg(long, env = "KVEPP_REPLICA_SYNC_PEERS", value_delimiter = ',')]
    pub replica_sync_peers: Option<Vec<String>>,
    /// Replica sync on Kubernetes: peers are the ready endpoints of this Service (kvepp's own).
    #[arg(long, env = "KVEPP_REPLICA_SYNC_PEERS_SERVICE")]
    pub replica_sync_peers_service: Option<String>,
    /// Comma-separated HTTP URLs of peers whose /dump the KV index is recovered from at start.
    #[arg(long, env = "KVEPP_INDEXER_PEERS", value_delimiter = ',')]
    pub indexer_peers: Option<Vec<String>>,
}

macro_rules! overlay {
    ($cfg:ident, $args:ident, $($field:ident),+ $(,)?) => {
        $( if let Some(v) = $args.$field.clone() { $cfg.$field = v; } )+
    };
}

impl Config {
    /// Builds and validates the configuration from the file and the flags.
    pub fn load(args: &ServeArgs) -> Result<Config, ConfigError> {
        let mut cfg = match &args.config {
            Some(path) => Self::from_file(path)?,
            None => Config::default(),
        };
        overlay!(
            cfg,
            args,
            grpc_port,
            grpc_health_port,
            metrics_port,
            pool_name,
            pool_namespace,
            manifests_poll_ms,
            unknown_models,
            destination_endpoint_list,
            emit_endpoint_scores,
            max_in_flight_per_endpoint,
            max_body_bytes,
            shutdown_grace_seconds,
            log_format,
            log_level,
            picker
        );
        let mut errs = Vec::new();
        for (field, flag, slot) in [
            ("bind_address", &args.bind_address, &mut cfg.bind_address),
            (
                "admin_bind_address",
                &args.admin_bind_address,
                &mut cfg.admin_bind_address,
            ),
        ] {
            if let Some(v) = flag {
                match v.parse::<IpAddr>() {
                    Ok(ip) => *slot = ip,
                    Err(_) => errs.push(FieldError {
                        field,
                        message: format!("{v:?} is not an IP address"),
                    }),
                }
            }
        }
        if let Some(m) = args.grpc_tls_mode {
            cfg.grpc_tls.mode = m;
        }
        if let Some(p) = args.grpc_tls_accept_plaintext {
            cfg.grpc_tls.accept_plaintext = p;
        }
        for (flag, slot) in [
            (&args.grpc_tls_cert_file, &mut cfg.grpc_tls.cert_file),
            (&args.grpc_tls_key_file, &mut cfg.grpc_tls.key_file),
            (
                &args.grpc_tls_client_ca_file,
                &mut cfg.grpc_tls.client_ca_file,
            ),
            (&args.api_token_file, &mut cfg.api_token_file),
        ] {
            if flag.is_some() {
                slot.clone_from(flag);
            }
        }
        if args.block_size.is_some() {
            cfg.block_size = args.block_size;
        }
        if args.replica_sync_bind.is_some() {
            cfg.replica_sync.bind = args.replica_sync_bind.clone();
        }
        if args.replica_sync_advertise.is_some() {
            cfg.replica_sync.advertise = args.replica_sync_advertise.clone();
        }
        if let Some(p) = &args.replica_sync_peers {
            cfg.replica_sync.peers = p
                .iter()
                .map(|e| e.trim().to_owned())
                .filter(|e| !e.is_empty())
                .collect();
        }
        if let Some(p) = &args.indexer_peers {
            cfg.replica_sync.indexer_peers = p
                .iter()
                .map(|e| e.trim().to_owned())
                .filter(|e| !e.is_empty())
                .collect();
        }
        if args.replica_sync_peers_service.is_some() {
            cfg.replica_sync.peers_service = args.replica_sync_peers_service.clone();
        }
        if args.select_service_port.is_some() {
            cfg.select_service_port = args.select_service_port;
        }
        if args.slot_tracker_port.is_some() {
            cfg.slot_tracker_port = args.slot_tracker_port;
        }
        if let Some(v) = args.kv_events_enabled {
            cfg.kv_events.enabled = v;
        }
        if let Some(v) = args.kv_events_port {
            cfg.kv_events.port = v;
        }
        if args.kv_events_replay_port.is_some() {
            cfg.kv_events.replay_port = args.kv_events_replay_port;
        }
        // Dynamo's knobs from the environment override the file.
        match router_knobs_from_env(cfg.router, |k| std::env::var(k).ok()) {
            Ok(w) => cfg.router = w,
            Err(bad) => errs.extend(bad.into_iter().map(|e| FieldError {
                field: e.name,
                message: e.message,
            })),
        }
        if args.endpoint_service.is_some() {
            cfg.endpoint_service = args.endpoint_service.clone();
        }
        if args.endpoint_picker_service.is_some() {
            cfg.endpoint_picker_service = args.endpoint_picker_service.clone();
        }
        if let Some(v) = args.flow_control {
            cfg.flow_control.enabled = v;
        }
        if let Some(v) = args.flow_control_max_wait_ms {
            cfg.flow_control.max_wait_ms = v;
        }
        if args.manifests_dir.is_some() {
            cfg.manifests_dir = args.manifests_dir.clone();
        }
        if args.kubeconfig.is_some() {
            cfg.kubeconfig = args.kubeconfig.clone();
        }
        if let Err(bad) = cfg.validate() {
            errs.extend(bad);
        }
        if !errs.is_empty() {
            return Err(ConfigError::Invalid(errs));
        }
        Ok(cfg)
    }

    pub fn from_file(path: &std::path::Path) -> Result<Config, ConfigError> {
        let text = std::fs::read(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        serde_yaml::from_slice(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })
    }

    /// Checks every field; returns one error per bad field.
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errs = Vec::new();
        let mut bad =
            |field: &'static str, message: String| errs.push(FieldError { field, message });
        if !is_dns_label(&self.pool_name) {
            bad("pool_name", format!("{:?} must be a Kubernetes object name (lowercase letters, digits, '-', '.'; required)", self.pool_name));
        }
        if !is_dns_label(&self.pool_namespace) {
            bad(
                "pool_namespace",
                format!(
                    "{:?} is not a Kubernetes namespace name",
                    self.pool_namespace
                ),
            );
        }
        if let Some(svc) = &self.endpoint_service {
            if !is_dns_label(svc) {
                bad(
                    "endpoint_service",
                    format!("{svc:?} is not a Kubernetes Service name"),
                );
            }
        }
        if let Some(svc) = &self.endpoint_picker_service {
            if !is_dns_label(svc) {
                bad(
                    "endpoint_picker_service",
                    format!("{svc:?} is not a Kubernetes Service name"),
                );
            }
        }
        for p in self.flow_control.problems() {
            bad("flow_control", p);
        }
        if let Some(d) = self.manifests_dir.as_ref().filter(|d| !d.is_dir()) {
            bad(
                "manifests_dir",
                format!("{} is not a directory", d.display()),
            );
        }
        if let Some(k) = self.kubeconfig.as_ref().filter(|k| !k.is_file()) {
            bad("kubeconfig", format!("{} is not a file", k.display()));
        }
        if !(10..=60_000).contains(&self.manifests_poll_ms) {
            bad(
                "manifests_poll_ms",
                format!("{} must be between 10 and 60000", self.manifests_poll_ms),
            );
        }
        if self.max_body_bytes < 1024 || self.max_body_bytes > 256 << 20 {
            bad(
                "max_body_bytes",
                format!("{} must be between 1 KiB and 256 MiB", self.max_body_bytes),
            );
        }
        let ports = [
            ("grpc_port", self.grpc_port),
            ("grpc_health_port", self.grpc_health_port),
            ("metrics_port", self.metrics_port),
            ("select_service_port", self.select_service_port.unwrap_or(0)),
            ("slot_tracker_port", self.slot_tracker_port.unwrap_or(0)),
        ];
        for problem in self.grpc_tls.problems() {
            bad("grpc_tls", problem);
        }
        if let Some(f) = &self.api_token_file {
            if let Err(e) = crate::api::auth::ApiToken::from_file(f) {
                bad("api_token_file", e.to_string());
            }
        }
        for problem in self.replica_sync.problems() {
            bad("replica_sync", problem);
        }
        if self.replica_sync.bind.is_some()
            && matches!(
                self.picker,
                PickerKind::LeastLoaded | PickerKind::RoundRobin
            )
        {
            bad(
                "replica_sync",
                "replica sync shares the KV-aware picker's bookings: it needs picker kv-aware or approximate-prefix".to_string(),
            );
        }
        let http_doors = self.select_service_port.is_some() || self.slot_tracker_port.is_some();
        if http_doors
            && matches!(
                self.picker,
                PickerKind::LeastLoaded | PickerKind::RoundRobin
            )
        {
            bad(
                "select_service_port",
                "the selection and slot-tracker services need a KV-aware picker (kv-aware or approximate-prefix)".to_string(),
            );
        }
        for (i, (name, port)) in ports.iter().enumerate() {
            if *port != 0 && ports[..i].iter().any(|(_, p)| p == port) {
                bad(
                    name,
                    format!("port {port} is already used by another server"),
                );
            }
        }
        if self.startup_wait_ms > 60_000 {
            bad(
                "startup_wait_ms",
                format!("{} must be at most 60000", self.startup_wait_ms),
            );
        }
        if let Some(bs) = self.block_size.filter(|bs| !(1..=1024).contains(bs)) {
            bad(
                "block_size",
                format!("{bs} must be between 1 and 1024 tokens"),
            );
        }
        let em = &self.engine_metrics;
        if !(10..=60_000).contains(&em.interval_ms) {
            bad(
                "engine_metrics.interval_ms",
                format!("{} must be between 10 and 60000", em.interval_ms),
            );
        }
        if em.stale_after_ms < 2 * em.interval_ms {
            bad(
                "engine_metrics.stale_after_ms",
                format!(
                    "{} must be at least twice interval_ms ({})",
                    em.stale_after_ms, em.interval_ms
                ),
            );
        }
        if !(10..=60_000).contains(&em.timeout_ms) {
            bad(
                "engine_metrics.timeout_ms",
                format!("{} must be between 10 and 60000", em.timeout_ms),
            );
        }
        if em.max_page_bytes < 1024 {
            bad(
                "engine_metrics.max_page_bytes",
                format!("{} must be at least 1024", em.max_page_bytes),
            );
        }
        let md = &self.engine_metadata;
        if md.timeout_ms == 0 || md.refresh_ms == 0 || md.backoff_min_ms == 0 {
            bad(
                "engine_metadata",
                "refresh_ms, timeout_ms and backoff_min_ms must be above 0".into(),
            );
        }
        if em.kv_cache_threshold.is_nan() || em.kv_cache_threshold <= 0.0 {
            bad(
                "engine_metrics.kv_cache_threshold",
                format!("{} must be > 0 (≥ 1 disables)", em.kv_cache_threshold),
            );
        }
        for e in self.router.validate() {
            bad("router", format!("{}: {}", e.name, e.message));
        }
        if self.kv_events.enabled && self.kv_events.port == 0 {
            bad(
                "kv_events.port",
                "must not be 0 when KV events are enabled".into(),
            );
        }
        for (model, dir) in &self.tokenizers {
            if !dir.join("tokenizer.json").is_file() {
                bad(
                    "tokenizers",
                    format!("{model}: {} has no tokenizer.json", dir.display()),
                );
            }
        }
        if self.approx_blocks_per_endpoint == 0 {
            bad("approx_blocks_per_endpoint", "must be at least 1".into());
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log_level).is_err() {
            bad(
                "log_level",
                format!("{:?} is not a valid log filter", self.log_level),
            );
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(errs)
        }
    }

    pub fn endpoint_service(&self) -> &str {
        self.endpoint_service.as_deref().unwrap_or(&self.pool_name)
    }
}

/// Applies the `DYN_ROUTER_*` variables Dynamo users already set, read through `get` (e.g.
/// `|k| std::env::var(k).ok()`). The deprecated overlap-score-weight names set the prefill load
/// scale (and a 0 also zeroes the overlap credit), as in Dynamo. Every bad value is reported.
pub fn router_knobs_from_env(
    mut w: CostWeights,
    get: impl Fn(&str) -> Option<String>,
) -> Result<CostWeights, Vec<KnobError>> {
    let mut errors = Vec::new();
    let mut read = |name: &'static str, slot: &mut f64| {
        if let Some(raw) = get(name) {
            match raw.trim().parse::<f64>() {
                Ok(v) => *slot = v,
                Err(_) => errors.push(KnobError {
                    name,
                    message: format!("{raw:?} is not a number"),
                }),
            }
        }
    };
    read(
        "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT",
        &mut w.overlap_score_credit,
    );
    read(
        "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT",
        &mut w.host_cache_hit_weight,
    );
    read(
        "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT",
        &mut w.disk_cache_hit_weight,
    );
    read("DYN_ROUTER_PREFILL_LOAD_SCALE", &mut w.prefill_load_scale);
    read(
        "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT",
        &mut w.decode_active_request_weight,
    );
    read("DYN_ROUTER_TEMPERATURE", &mut w.temperature);
    for name in [
        "DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT",
        "DYN_OVERLAP_SCORE_WEIGHT",
    ] {
        let mut legacy = f64::NAN;
        read(name, &mut legacy);
        if !legacy.is_nan() {
            tracing::warn!("{name} is deprecated; use DYN_ROUTER_PREFILL_LOAD_SCALE");
            w.prefill_load_scale = legacy;
            if legacy == 0.0 {
                w.overlap_score_credit = 0.0;
            }
            break;
        }
    }
    errors.extend(w.validate());
    if errors.is_empty() {
        Ok(w)
    } else {
        Err(errors)
    }
}

fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_then_flags() {
        let dir = kvepp_test_support::TempDir::new("config");
        let file = dir.path().join("kvepp.yaml");
        std::fs::write(&file, format!("pool_name: from-file\ngrpc_port: 7000\nmanifests_dir: {}\nunknown_models: pass-through\n", dir.path().display())).unwrap();
        let args = ServeArgs {
            config: Some(file.clone()),
            grpc_port: Some(7001),
            ..Default::default()
        };
        let cfg = Config::load(&args).unwrap();
        assert_eq!(
            (cfg.pool_name.as_str(), cfg.grpc_port, cfg.metrics_port),
            ("from-file", 7001, 9090)
        );
        assert_eq!(cfg.unknown_models, UnknownModels::PassThrough);
        assert_eq!(cfg.endpoint_service(), "from-file");

        std::fs::write(&file, "pool_name: x\nno_such_field: 1\n").unwrap();
        let err = Config::load(&ServeArgs {
            config: Some(file),
            ..Default::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("no_such_field"), "{err}");
    }

    #[test]
    fn every_bad_field_is_reported() {
        let cfg = Config {
            pool_name: "Bad_Name".into(),
            metrics_port: 9002,
            max_body_bytes: 10,
            log_level: "[[[".into(),
            manifests_dir: Some("/nonexistent/kvepp".into()),
            ..Config::default()
        };
        let errs = cfg.validate().unwrap_err();
        let fields: Vec<&str> = errs.iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            vec![
                "pool_name",
                "manifests_dir",
                "max_body_bytes",
                "metrics_port",
                "log_level"
            ]
        );
        let text = ConfigError::Invalid(errs).to_string();
        assert!(text.contains("pool_name: \"Bad_Name\""), "{text}");
    }

    #[test]
    fn env_knobs_like_dynamo() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let w = router_knobs_from_env(
            CostWeights::default(),
            env(&[
                ("DYN_ROUTER_TEMPERATURE", "0.3"),
                ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "0.5"),
                ("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT", " 0.6 "),
            ]),
        )
        .unwrap();
        assert_eq!(
            (
                w.temperature,
                w.overlap_score_credit,
                w.host_cache_hit_weight,
                w.prefill_load_scale
            ),
            (0.3, 0.5, 0.6, 1.0)
        );
        let w = router_knobs_from_env(
            CostWeights::default(),
            env(&[("DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT", "2")]),
        )
        .unwrap();
        assert_eq!((w.prefill_load_scale, w.overlap_score_credit), (2.0, 1.0));
        let w = router_knobs_from_env(
            CostWeights::default(),
            env(&[("DYN_OVERLAP_SCORE_WEIGHT", "0")]),
        )
        .unwrap();
        assert_eq!((w.prefill_load_scale, w.overlap_score_credit), (0.0, 0.0));
        let errs = router_knobs_from_env(
            CostWeights::default(),
            env(&[
                ("DYN_ROUTER_TEMPERATURE", "hot"),
                ("DYN_ROUTER_PREFILL_LOAD_SCALE", "-1"),
                ("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT", "NaN"),
            ]),
        )
        .unwrap_err();
        let names: Vec<&str> = errs.iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            [
                "DYN_ROUTER_TEMPERATURE",
                "disk_cache_hit_weight",
                "prefill_load_scale"
            ]
        );
    }
}
