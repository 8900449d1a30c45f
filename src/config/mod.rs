//! The single typed configuration of `kvepp serve`.
//!
//! Precedence, lowest to highest: built-in defaults → the `--config` file (YAML or JSON, unknown
//! fields rejected) → environment variables → command-line flags. Every field is validated at
//! startup and each bad field gets its own message; the effective configuration is logged once.
//!
//! This module holds the tree, its defaults and validation; [`args`] the flag and environment
//! layers, [`tls`] the ext_proc TLS settings.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use kvepp_core::cost::CostWeights;
use kvepp_core::{KvSettings, TransferSettings};

use crate::engine::metadata::FetchSettings;
pub use crate::engine::metrics::EngineMetricsConfig;
pub use crate::kv_events::KvEventsConfig;
pub use crate::process::LogFormat;
pub use crate::replica::ReplicaSyncConfig;

pub mod agent;
mod args;
pub(crate) mod live;
pub(crate) mod standalone;
mod tls;
mod validate;

pub use args::{router_knobs_from_env, transfer_from_env, ServeArgs};
pub use tls::{GrpcTls, TlsMode};

/// What to do with a request whose model matches no InferenceModel.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum UnknownModels {
    /// 404, as the EPP protocol requires.
    Reject,
    /// Route it with Standard criticality and no rewrite (newer reference EPPs).
    PassThrough,
}

/// Which picker ranks the candidates.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, schemars::JsonSchema,
)]
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

impl PickerKind {
    /// The name the configuration uses.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            PickerKind::KvAware => "kv-aware",
            PickerKind::ApproximatePrefix => "approximate-prefix",
            PickerKind::LeastLoaded => "least-loaded",
            PickerKind::RoundRobin => "round-robin",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// Namespace of the InferencePool (and of the objects kvepp watches).
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
    /// A request whose model matches no InferenceModel or rewrite: `reject` (404) or `pass-through`.
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
    pub flow_control: crate::admission::FlowControlSettings,
    /// Tenant rate limits: token buckets per fairness id, globally or per InferenceObjective.
    pub rate_limits: crate::admission::RateLimitSettings,
    /// In-flight requests at which an endpoint is saturated (Sheddable requests get 429 when every
    /// eligible endpoint is); 0 disables shedding.
    pub max_in_flight_per_endpoint: u32,
    /// Largest request body kvepp accepts (413 above it).
    pub max_body_bytes: usize,
    /// Grace period for open streams on SIGTERM, in seconds (after `shutdown_delay_ms`).
    pub shutdown_grace_seconds: u64,
    /// On SIGTERM, how long kvepp reports not ready while still taking new streams, before it
    /// closes its listeners (HTTP/2 GOAWAY): the time the proxy's health checks need to stop
    /// sending it streams (Envoy's `interval` + `timeout` of the ext_proc cluster's check).
    pub shutdown_delay_ms: u64,
    /// How long an ext_proc stream waits for the pool to be loaded after a start before it is
    /// answered 503, in milliseconds (0: answer at once).
    pub startup_wait_ms: u64,
    /// Log line format: `text` or `json`.
    pub log_format: LogFormat,
    /// tracing filter, e.g. `info` or `kvepp=debug`.
    pub log_level: String,
    /// Which picker ranks the candidates.
    pub picker: PickerKind,
    /// Tokens per KV block, as the engines are configured (`--block-size`); unset: learned from the
    /// engines (`vllm:cache_config_info`, `sglang:page_size`, or the block size their KV events
    /// store; the core's default, 16, until then).
    pub block_size: Option<u32>,
    /// Scraping the engines' Prometheus `/metrics` (vLLM and SGLang names) for load and saturation.
    pub engine_metrics: EngineMetricsConfig,
    /// Fetching each endpoint's `/metadata` (block size, model, KV-event sockets).
    pub engine_metadata: FetchSettings,
    /// The KV-aware cost knobs; the `DYN_ROUTER_*` environment variables override the file.
    pub router: CostWeights,
    /// Prefill/decode pools: prompt length that skips the prefill hop, the KV-transfer topology
    /// level and mismatch policy (`DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL`,
    /// `DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY` override the file), and the soft transfer cost.
    pub disaggregation: TransferSettings,
    /// LoRA adapters: prefer engines that run the request's adapter (from their
    /// `vllm:lora_requests_info`), then a free adapter slot, then an eviction.
    pub adapter_affinity: kvepp_core::affinity::AdapterAffinity,
    /// Sticky sessions: requests carrying the session header go to the endpoint their session is
    /// bound to while it can take them; bindings are shared by replicas (replica sync).
    pub session_affinity: kvepp_core::affinity::SessionAffinity,
    /// Grove ClusterTopology (cluster-scoped) whose levels `kv_transfer_topology_level` must be
    /// one of: checked at start, which is refused when Grove is not installed, the topology does
    /// not exist or lacks the level (the design's admission checks). Unset: not checked.
    pub cluster_topology: Option<String>,
    /// Subscribing to the engines' KV events (ZMQ) for the KV index.
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
    /// OpenTelemetry traces over OTLP: one span per routing decision (off unless an endpoint is
    /// set; the `OTEL_*` variables apply).
    pub tracing: crate::telemetry::TracingConfig,
    /// `kvepp select-service`: the standalone selection service.
    pub select_service: standalone::SelectServiceConfig,
    /// `kvepp slot-tracker`: the standalone slot tracker.
    pub slot_tracker: standalone::SlotTrackerConfig,
    /// `kvepp worker-agent` / `kvepp-agent`: the sidecar's flags by name (`component: pool`,
    /// `engine_port: 8000`, `topology: [zone=a]`), as `kvepp worker-agent`'s flags below name them.
    #[schemars(with = "std::collections::BTreeMap<String, serde_json::Value>")]
    pub worker_agent: std::collections::BTreeMap<String, serde_yaml::Value>,
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
            rate_limits: Default::default(),
            max_in_flight_per_endpoint: 128,
            max_body_bytes: 8 << 20,
            shutdown_grace_seconds: 25,
            shutdown_delay_ms: 3_000,
            startup_wait_ms: 5_000,
            log_format: LogFormat::Text,
            log_level: "info".into(),
            picker: PickerKind::KvAware,
            block_size: None,
            engine_metrics: EngineMetricsConfig::default(),
            engine_metadata: FetchSettings::default(),
            router: CostWeights::default(),
            disaggregation: TransferSettings::default(),
            adapter_affinity: Default::default(),
            session_affinity: Default::default(),
            cluster_topology: None,
            kv_events: KvEventsConfig::default(),
            replica_sync: ReplicaSyncConfig::default(),
            approx_blocks_per_endpoint: KvSettings::default().approx_blocks_per_endpoint,
            tokenizers: Default::default(),
            tracing: Default::default(),
            select_service: Default::default(),
            slot_tracker: Default::default(),
            worker_agent: Default::default(),
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

impl Config {
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
        self.pool_problems(&mut bad);
        self.server_problems(&mut bad);
        self.engine_problems(&mut bad);
        self.routing_problems(&mut bad);
        self.shared_problems(&mut bad);
        self.tracing.problems(&mut bad);
        // The standalone services' sections too: one file may configure every process.
        self.select_service.problems(&mut bad);
        self.slot_tracker.problems(&mut bad);
        if let Err(ConfigError::Invalid(errs)) = agent::check_section(&self.worker_agent) {
            errs.into_iter().for_each(|e| bad(e.field, e.message));
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
    fn the_cost_model_defaults_to_the_whole_request_and_dynamo_stays_selectable() {
        let cfg = Config::default();
        assert_eq!(
            (cfg.router.cost_model, cfg.router.speculative),
            (kvepp_core::cost::CostModel::PredictedCompletion, true)
        );
        for (text, model) in [
            ("dynamo", kvepp_core::cost::CostModel::Dynamo),
            ("predicted_ttft", kvepp_core::cost::CostModel::PredictedTtft),
            (
                "predicted_completion",
                kvepp_core::cost::CostModel::PredictedCompletion,
            ),
        ] {
            let yaml = format!("router:\n  cost_model: {text}\n  speculative: false\n");
            let cfg: Config = serde_yaml::from_str(&yaml).unwrap();
            assert_eq!(
                (cfg.router.cost_model, cfg.router.speculative),
                (model, false)
            );
            assert_eq!(model.as_str(), text);
        }
        assert!(serde_yaml::from_str::<Config>("router:\n  cost_model: fastest\n").is_err());
    }

    #[test]
    fn load_bound_from_the_file_and_its_errors() {
        let cfg: Config =
            serde_yaml::from_str("router:\n  load_bound: 1.25\n  load_bound_cached: 1.5\n")
                .unwrap();
        assert_eq!(cfg.router.load_bound, 1.25);
        assert_eq!(cfg.router.load_bound_cached, 1.5);
        assert_eq!(cfg.router.load_bound_exempt_cached, 0.25, "its default");
        let router_errors = |c: &Config| {
            c.validate()
                .err()
                .unwrap_or_default()
                .into_iter()
                .filter(|e| e.field == "router")
                .count()
        };
        assert_eq!(router_errors(&cfg), 0);
        let bad: Config = serde_yaml::from_str(
            "router:\n  load_bound: 0.5\n  load_bound_exempt_cached: -1\n  load_bound_cached: 0.8\n",
        )
        .unwrap();
        let text = ConfigError::Invalid(bad.validate().unwrap_err()).to_string();
        assert!(
            text.contains("load_bound: 0.5 must be 0 (off) or a finite number ≥ 1"),
            "{text}"
        );
        assert!(
            text.contains("load_bound_exempt_cached: -1 must be a finite number ≥ 0"),
            "{text}"
        );
        assert!(
            text.contains("load_bound_cached: 0.8 must be 0 (unbounded) or a finite number ≥ 1"),
            "{text}"
        );
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

    #[test]
    fn kv_transfer_topology_from_file_and_environment() {
        let file: Config = serde_yaml::from_str(
            "disaggregation:\n  kv_transfer_topology_level: rack\n  kv_transfer_mismatch_policy: fallback\n  kv_transfer_weight: 2.5\n  prefill_threshold_tokens: 256\n  transfer_qos: [{level: rack, latency_ms: 0.1, bandwidth_gb_per_s: 40}]\n",
        )
        .unwrap();
        let d = &file.disaggregation;
        assert_eq!(d.kv_transfer_topology_level.as_deref(), Some("rack"));
        assert_eq!(
            d.kv_transfer_mismatch_policy,
            kvepp_core::MismatchPolicy::Fallback
        );
        assert_eq!(
            (d.kv_transfer_weight, d.prefill_threshold_tokens),
            (2.5, 256)
        );
        assert_eq!(d.transfer_qos.len(), 1);
        // Unset by default: no filtering, fail when set.
        let def = Config::default().disaggregation;
        assert_eq!(def.kv_transfer_topology_level, None);
        assert_eq!(
            def.kv_transfer_mismatch_policy,
            kvepp_core::MismatchPolicy::Fail
        );
        // The variables override the file.
        let mut t = file.disaggregation.clone();
        let vars = [
            ("DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL", "zone"),
            ("DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY", "fail"),
        ];
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        transfer_from_env(&mut t, get).unwrap();
        assert_eq!(t.kv_transfer_topology_level.as_deref(), Some("zone"));
        assert_eq!(
            t.kv_transfer_mismatch_policy,
            kvepp_core::MismatchPolicy::Fail
        );
        // An empty level variable unsets the level; a bad policy or weight is reported by name.
        let errs = transfer_from_env(&mut t, |k: &str| match k {
            "DYN_ROUTER_KV_TRANSFER_TOPOLOGY_LEVEL" => Some(String::new()),
            "DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY" => Some("maybe".into()),
            "DYN_ROUTER_KV_TRANSFER_WEIGHT" => Some("heavy".into()),
            _ => None,
        })
        .unwrap_err();
        assert_eq!(t.kv_transfer_topology_level, None);
        let fields: Vec<&str> = errs.iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            [
                "DYN_ROUTER_KV_TRANSFER_MISMATCH_POLICY",
                "DYN_ROUTER_KV_TRANSFER_WEIGHT"
            ]
        );
        let bad = Config {
            disaggregation: kvepp_core::TransferSettings {
                kv_transfer_weight: -1.0,
                ..Default::default()
            },
            ..Config::default()
        };
        let errs = bad.validate().unwrap_err();
        assert!(errs
            .iter()
            .any(|e| e.field == "disaggregation" && e.message.contains("kv_transfer_weight")));
    }
}
