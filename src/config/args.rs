//! The flag and environment layers of the configuration: `kvepp serve`'s flags (each with its
//! `KVEPP_*` variable) laid over the file, and Dynamo's `DYN_ROUTER_*` knobs. Every value read here
//! is validated with the rest of the configuration ([`Config::validate`]).

use std::net::IpAddr;
use std::path::PathBuf;

use kvepp_core::cost::{CostWeights, KnobError};
use kvepp_core::{MismatchPolicy, TransferSettings};

use super::{Config, ConfigError, FieldError, LogFormat, PickerKind, TlsMode, UnknownModels};

/// Flags (and their environment variables) of `kvepp serve`. Every flag overrides the file.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct ServeArgs {
    /// Configuration file (YAML or JSON); flags and environment variables override it.
    #[arg(long, env = "KVEPP_CONFIG")]
    pub config: Option<PathBuf>,
    /// ext_proc gRPC port.
    #[arg(long, env = "KVEPP_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// gRPC health port (`liveness`, `readiness`, the ext_proc service).
    #[arg(long, env = "KVEPP_GRPC_HEALTH_PORT")]
    pub grpc_health_port: Option<u16>,
    /// Prometheus `/metrics`, HTTP `/health`, `/ready` and `/debug/*` port.
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
    /// PEM certificate chain of the ext_proc port (mode files).
    #[arg(long, env = "KVEPP_GRPC_TLS_CERT_FILE")]
    pub grpc_tls_cert_file: Option<PathBuf>,
    /// PEM private key of the ext_proc port (mode files).
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
    /// InferencePool this EPP serves.
    #[arg(long, env = "KVEPP_POOL_NAME")]
    pub pool_name: Option<String>,
    /// Namespace of the InferencePool.
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
    /// How often the manifests directory is re-read, in milliseconds.
    #[arg(long, env = "KVEPP_MANIFESTS_POLL_MS")]
    pub manifests_poll_ms: Option<u64>,
    /// A model that matches no InferenceModel: 404 (reject) or routed as Standard.
    #[arg(long, env = "KVEPP_UNKNOWN_MODELS", value_enum)]
    pub unknown_models: Option<UnknownModels>,
    /// Ordered-list form `primary,fallback` in the destination header and metadata.
    #[arg(long, env = "KVEPP_DESTINATION_ENDPOINT_LIST")]
    pub destination_endpoint_list: Option<bool>,
    /// In-flight requests at which an endpoint is saturated (0: never).
    #[arg(long, env = "KVEPP_MAX_IN_FLIGHT_PER_ENDPOINT")]
    pub max_in_flight_per_endpoint: Option<u32>,
    /// Send every candidate's score in x-gateway-destination-endpoint-scores.
    #[arg(long, env = "KVEPP_EMIT_ENDPOINT_SCORES")]
    pub emit_endpoint_scores: Option<bool>,
    /// kvepp's own Service name: pools whose picker reference names another are not served.
    #[arg(long, env = "KVEPP_ENDPOINT_PICKER_SERVICE")]
    pub endpoint_picker_service: Option<String>,
    /// Grove ClusterTopology that `kv_transfer_topology_level` must be a level of (checked at start).
    #[arg(long, env = "KVEPP_CLUSTER_TOPOLOGY")]
    pub cluster_topology: Option<String>,
    /// Queue requests that find every endpoint saturated (flow_control.enabled).
    #[arg(long, env = "KVEPP_FLOW_CONTROL")]
    pub flow_control: Option<bool>,
    /// Longest wait in the flow-control queue before a 503 (flow_control.max_wait_ms).
    #[arg(long, env = "KVEPP_FLOW_CONTROL_MAX_WAIT_MS")]
    pub flow_control_max_wait_ms: Option<u64>,
    /// Largest request body accepted (413 above it).
    #[arg(long, env = "KVEPP_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Grace for open streams on SIGTERM, in seconds.
    #[arg(long, env = "KVEPP_SHUTDOWN_GRACE_SECONDS")]
    pub shutdown_grace_seconds: Option<u64>,
    /// On SIGTERM, how long kvepp reports not ready before closing its listeners.
    #[arg(long, env = "KVEPP_SHUTDOWN_DELAY_MS")]
    pub shutdown_delay_ms: Option<u64>,
    /// Log line format.
    #[arg(long, env = "KVEPP_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// tracing filter, e.g. info or kvepp=debug.
    #[arg(long, env = "KVEPP_LOG_LEVEL")]
    pub log_level: Option<String>,
    /// Which picker ranks the candidates.
    #[arg(long, env = "KVEPP_PICKER", value_enum)]
    pub picker: Option<PickerKind>,
    /// Tokens per KV block, as the engines use (default: learned from them).
    #[arg(long, env = "KVEPP_BLOCK_SIZE")]
    pub block_size: Option<u32>,
    /// Subscribe to the endpoints' KV events at `tcp://<address>:<kv-events-port>`.
    #[arg(long, env = "KVEPP_KV_EVENTS_ENABLED")]
    pub kv_events_enabled: Option<bool>,
    /// Engines' KV-event PUB port, when their /metadata does not say.
    #[arg(long, env = "KVEPP_KV_EVENTS_PORT")]
    pub kv_events_port: Option<u16>,
    /// Engines' KV-event replay port, when their /metadata does not say.
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
            shutdown_delay_ms,
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
        overlay_options(&mut cfg, args);
        // Dynamo's knobs from the environment override the file.
        match router_knobs_from_env(cfg.router, |k| std::env::var(k).ok()) {
            Ok(w) => cfg.router = w,
            Err(bad) => errs.extend(bad.into_iter().map(|e| FieldError {
                field: e.name,
                message: e.message,
            })),
        }
        if let Err(bad) = transfer_from_env(&mut cfg.disaggregation, |k| std::env::var(k).ok()) {
            errs.extend(bad);
        }
        // OpenTelemetry's variables override the file's `tracing` section.
        let otel = cfg.tracing.apply_env(|k| std::env::var(k).ok());
        errs.extend(
            otel.into_iter()
                .map(|(field, message)| FieldError { field, message }),
        );
        if let Err(bad) = cfg.validate() {
            errs.extend(bad);
        }
        if !errs.is_empty() {
            return Err(ConfigError::Invalid(errs));
        }
        Ok(cfg)
    }
}

/// The flags (and their variables) that set optional values and nested sections.
fn overlay_options(cfg: &mut Config, args: &ServeArgs) {
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
    if args.endpoint_service.is_some() {
        cfg.endpoint_service = args.endpoint_service.clone();
    }
    if args.endpoint_picker_service.is_some() {
        cfg.endpoint_picker_service = args.endpoint_picker_service.clone();
    }
    if args.cluster_topology.is_some() {
        cfg.cluster_topology = args.cluster_topology.clone();
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
}

/// Applies Dynamo's KV-transfer topology variables (read through `get`):
/// `DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL` (empty: unset), `DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY`
/// (`fail` | `fallback`) and `DYN_ROUTER_KV_TRANSFER_WEIGHT`.
pub fn transfer_from_env(
    t: &mut TransferSettings,
    get: impl Fn(&str) -> Option<String>,
) -> Result<(), Vec<FieldError>> {
    let mut errors = Vec::new();
    if let Some(level) = get("DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL") {
        let level = level.trim();
        t.kv_transfer_topology_level = (!level.is_empty()).then(|| level.to_owned());
    }
    if let Some(raw) = get("DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY") {
        match MismatchPolicy::parse(&raw) {
            Some(p) => t.kv_transfer_mismatch_policy = p,
            None => errors.push(FieldError {
                field: "DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY",
                message: format!("{raw:?} is not fail or fallback"),
            }),
        }
    }
    if let Some(raw) = get("DYN_ROUTER_KV_TRANSFER_WEIGHT") {
        match raw.trim().parse::<f64>() {
            Ok(v) => t.kv_transfer_weight = v,
            Err(_) => errors.push(FieldError {
                field: "DYN_ROUTER_KV_TRANSFER_WEIGHT",
                message: format!("{raw:?} is not a number"),
            }),
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
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
