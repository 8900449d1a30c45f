//! `kvepp-sim fleet`: a fleet of simulated inference engines on 127.0.0.1, for demos and for measuring
//! routing quality without GPUs.
//!
//! Each engine is one HTTP server (OpenAI `/v1/completions` and `/v1/chat/completions`, streamed
//! or not; `/metadata`; vLLM-named Prometheus `/metrics`; `/health`; `/debug/cache`;
//! `POST /debug/restart`), a [`cache::KvPool`] (prefix cache with pinning, generated blocks
//! cached), a continuous-batching scheduler with a time model and preemption ([`engine`]) and a
//! vLLM KV-event publisher with a replay socket ([`events`]). The fleet writes a manifests
//! directory (InferencePool, InferenceModel, one EndpointSlice per engine with ports `http` and
//! `metadata`) that `kvepp serve --manifests-dir` reads.
//!
//! Prompts: `prompt` as token ids is used as is; text (and chat messages) go through the
//! tokenizer the fleet is given (the same `tokenizer.json` kvepp is configured with), else one
//! token per byte.

pub mod cache;
pub mod engine;
pub mod events;
mod http;

pub use http::{ENGINE_HEADER, PREFILLED_BY_HEADER};

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use kvepp_core::disagg::{link_between, Domains, LevelQos, LinkQos};
use kvepp_core::Role;
use kvepp_tokenizer::ModelTokenizer;

/// The time model and sizes of every engine. Defaults: roughly Llama-3.1-8B (bf16) under vLLM on
/// one H100 80GB.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimParams {
    /// Served model name.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// KV blocks per engine: the prefix cache's capacity and the bound on running sequences'
    /// blocks. 8B bf16 keeps 128 KiB of KV per token; ~58 GiB free at 0.9 utilization ≈ 470k
    /// tokens ≈ 29,000 blocks of 16.
    pub total_kv_blocks: u64,
    /// Sequences running at once (vLLM `--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens per scheduler step (vLLM `--max-num-batched-tokens`, chunked prefill).
    pub max_num_batched_tokens: u64,
    /// Fixed cost of a step: one forward pass reading the weights (16 GB at ~3 TB/s ≈ 5-6 ms).
    pub step_overhead_us: f64,
    /// Prefill cost per uncached prompt token (~25k tokens/s: 16 GFLOP/token at ~40% of 990 TFLOPS).
    pub prefill_us_per_token: f64,
    /// Prefill attention cost per prompt token per 1,000 tokens of context before it: 4 × 32
    /// layers × 4096 × 1,000 ≈ 0.5 GFLOP at ~500 TFLOPS (FlashAttention, half of the bf16 peak).
    pub prefill_us_per_token_per_kctx: f64,
    /// Decode cost per running sequence per step besides its KV reads (sampling, scheduling).
    pub decode_us_per_seq: f64,
    /// Decode cost per 1,000 tokens of the batch's context per step: reading 1,000 tokens' KV
    /// (125 MiB at 128 KiB a token) at ~2.2 TB/s, two thirds of the H100's 3.35 TB/s.
    pub decode_us_per_kctx: f64,
    /// Output tokens per streamed chunk (vLLM `--stream-interval`); the first is sent at once.
    pub stream_interval: u32,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: u32,
    /// Disaggregated serving: KV-cache bytes per prompt token a decode engine pulls from its
    /// prefill engine (8B bf16: 128 KiB).
    pub kv_bytes_per_token: u64,
    /// The network a KV transfer crosses, narrowest shared topology level first (the first level
    /// whose value both engines share sets latency and bandwidth).
    pub transfer_qos: Vec<LevelQos>,
    /// Between engines that share no level.
    pub cross_domain_qos: LinkQos,
    /// GPU slots for LoRA adapters (`--max-loras`); 0: no LoRA (requests for any other model than
    /// `model` are refused, 404). With slots, any other model name is an adapter, loaded on demand.
    pub max_loras: u32,
    /// How long loading an adapter into a slot stalls the engine's step.
    pub lora_load_ms: f64,
}

impl Default for SimParams {
    fn default() -> Self {
        let transfer = kvepp_core::TransferSettings::default();
        SimParams {
            model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            block_size: 16,
            total_kv_blocks: 29_000,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            step_overhead_us: 6000.0,
            prefill_us_per_token: 40.0,
            prefill_us_per_token_per_kctx: 1.0,
            decode_us_per_seq: 20.0,
            decode_us_per_kctx: 60.0,
            stream_interval: 1,
            default_max_tokens: 16,
            // The router's default estimate of the network, as the simulated truth.
            kv_bytes_per_token: transfer.kv_bytes_per_token,
            transfer_qos: transfer.transfer_qos,
            cross_domain_qos: transfer.cross_domain_qos,
            max_loras: 0,
            lora_load_ms: 100.0,
        }
    }
}

impl SimParams {
    /// Milliseconds to move the KV cache of `tokens` prompt tokens between engines with these
    /// topology domains.
    pub fn transfer_ms(&self, a: &Domains, b: &Domains, tokens: u64) -> f64 {
        link_between(&self.transfer_qos, self.cross_domain_qos, a, b)
            .transfer_ms(tokens as f64 * self.kv_bytes_per_token as f64)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot read sim parameters {path}: {source}")]
    ReadParams {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("sim parameters {path}: {source}")]
    ParseParams {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("invalid sim parameters: {0}")]
    Invalid(String),
    #[error("cannot load the tokenizer: {0}")]
    Tokenizer(#[from] kvepp_tokenizer::TokenizeError),
    #[error("a fixed port ({port}) needs an address per engine: {engines} engines, {addresses} addresses")]
    SharedPort {
        port: u16,
        engines: usize,
        addresses: usize,
    },
    #[error("cannot bind an engine on {ip}: {source}")]
    Bind { ip: IpAddr, source: std::io::Error },
    #[error(transparent)]
    Events(#[from] events::BindError),
    #[error("cannot write the manifests to {path}: {source}")]
    Manifests {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl SimParams {
    pub fn from_file(path: &Path) -> Result<Self, SimError> {
        let text = std::fs::read(path).map_err(|source| SimError::ReadParams {
            path: path.into(),
            source,
        })?;
        let p: SimParams =
            serde_yaml::from_slice(&text).map_err(|source| SimError::ParseParams {
                path: path.into(),
                source,
            })?;
        p.validate()?;
        Ok(p)
    }

    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: &str| Err(SimError::Invalid(m.into()));
        if self.model.is_empty() {
            return bad("model must not be empty");
        }
        if !(1..=1024).contains(&self.block_size) {
            return bad("block_size must be between 1 and 1024");
        }
        if self.total_kv_blocks == 0 || self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return bad("total_kv_blocks, max_num_seqs and max_num_batched_tokens must be > 0");
        }
        let times = [
            self.step_overhead_us,
            self.prefill_us_per_token,
            self.prefill_us_per_token_per_kctx,
            self.decode_us_per_seq,
            self.decode_us_per_kctx,
        ];
        if times.iter().any(|t| !t.is_finite() || *t < 0.0) || self.step_overhead_us <= 0.0 {
            return bad("step_overhead_us must be > 0 and the per-token costs ≥ 0");
        }
        let mut links = self
            .transfer_qos
            .iter()
            .map(LevelQos::qos)
            .chain([self.cross_domain_qos]);
        if !links.all(|l| l.is_valid()) {
            return bad("transfer links need latency_ms ≥ 0 and bandwidth_gb_per_s > 0");
        }
        Ok(())
    }
}

/// How to start a fleet.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub engines: usize,
    pub params: SimParams,
    /// Directory with the `tokenizer.json` (and chat template) kvepp uses for the model.
    pub tokenizer: Option<PathBuf>,
    /// The address every engine binds, unless `ips` names one for it.
    pub ip: IpAddr,
    /// Engine `i`'s own address (as pods have), where given.
    pub ips: Vec<IpAddr>,
    /// Every engine's HTTP port (as a pool's target port is); 0: an ephemeral port each.
    pub port: u16,
    /// InferencePool (and Service) name in the generated manifests.
    pub pool_name: String,
    /// Role and topology of engine `i` (missing entries: `both`, no topology).
    pub layout: Vec<EngineLayout>,
}

/// One engine's place in a disaggregated fleet.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineLayout {
    pub role: Role,
    /// Topology domains (`zone`, `host`, ...), published in `/metadata` `topology_domains`.
    pub domains: Domains,
}

impl EngineLayout {
    /// `prefill` engines first, then `decode` ones; engine `i` is in zone `zones[i % n]` on its
    /// own host `host-i` (no zones: no topology).
    pub fn disaggregated(prefill: usize, decode: usize, zones: &[String]) -> Vec<EngineLayout> {
        (0..prefill + decode)
            .map(|i| {
                let mut domains = Domains::new();
                if !zones.is_empty() {
                    domains.insert("zone".into(), zones[i % zones.len()].clone());
                    domains.insert("host".into(), format!("host-{i}"));
                }
                EngineLayout {
                    role: if i < prefill {
                        Role::Prefill
                    } else {
                        Role::Decode
                    },
                    domains,
                }
            })
            .collect()
    }
}

impl Default for FleetSpec {
    fn default() -> Self {
        FleetSpec {
            engines: 4,
            params: SimParams::default(),
            tokenizer: None,
            ip: IpAddr::from([127, 0, 0, 1]),
            ips: Vec::new(),
            port: 0,
            pool_name: "sim-pool".into(),
            layout: Vec::new(),
        }
    }
}

/// A running engine.
#[derive(Debug, Clone)]
pub struct SimEngine {
    pub name: String,
    pub http: SocketAddr,
    pub layout: EngineLayout,
    pub kv_events: events::Publisher,
    pub core: Arc<engine::EngineCore>,
    commands: tokio::sync::mpsc::UnboundedSender<engine::Command>,
}

impl SimEngine {
    /// Restarts the engine as a new process on the same address would come up: running and
    /// waiting requests dropped, the cache empty, `AllBlocksCleared` published under sequence
    /// numbers from 0.
    pub fn restart(&self) {
        let _ = self.commands.send(engine::Command::Restart);
    }
}

/// A running fleet; engines stop when it is dropped.
#[derive(Debug)]
pub struct Fleet {
    pub engines: Vec<SimEngine>,
    pub spec: FleetSpec,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Fleet {
    pub async fn start(spec: FleetSpec) -> Result<Fleet, SimError> {
        spec.params.validate()?;
        if spec.port != 0 && spec.engines > 1 && spec.ips.len() < spec.engines {
            return Err(SimError::SharedPort {
                port: spec.port,
                engines: spec.engines,
                addresses: spec.ips.len(),
            });
        }
        let tokenizer = match &spec.tokenizer {
            Some(dir) => Some(Arc::new(ModelTokenizer::load(dir)?)),
            None => None,
        };
        let mut engines = Vec::with_capacity(spec.engines);
        let mut tasks = Vec::new();
        // Every engine's topology by address: what a decode engine's transfer crosses.
        let peers: http::Peers = Default::default();
        for i in 0..spec.engines {
            let layout = spec.layout.get(i).cloned().unwrap_or_default();
            let name = format!("sim-engine-{i}");
            let ip = spec.ips.get(i).copied().unwrap_or(spec.ip);
            let core = engine::EngineCore::new(spec.params.clone());
            let (commands, commands_rx) = tokio::sync::mpsc::unbounded_channel();
            let (events_tx, events_rx) = tokio::sync::mpsc::unbounded_channel();
            let kv_events =
                events::start(ip, String::new(), spec.params.block_size, events_rx).await?;
            tasks.push(tokio::spawn(engine::run(
                core.clone(),
                commands_rx,
                events_tx,
            )));
            let listener = tokio::net::TcpListener::bind((ip, spec.port))
                .await
                .map_err(|source| SimError::Bind { ip, source })?;
            let http = listener
                .local_addr()
                .map_err(|source| SimError::Bind { ip, source })?;
            let engine = SimEngine {
                name: name.clone(),
                http,
                layout: layout.clone(),
                kv_events,
                core: core.clone(),
                commands: commands.clone(),
            };
            let app = http::router(http::EngineApp {
                name: name.into(),
                commands: commands.clone(),
                core,
                tokenizer: tokenizer.clone(),
                metadata: Arc::new(metadata(&engine).to_string()),
                addr: http,
                domains: layout.domains.clone(),
                peers: peers.clone(),
            });
            peers.write().insert(http, layout.domains);
            tasks.push(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, app).await {
                    tracing::error!(%e, "simulated engine stopped");
                }
            }));
            engines.push(engine);
        }
        Ok(Fleet {
            engines,
            spec,
            tasks,
        })
    }

    /// Writes `pool.yaml` (InferencePool, InferenceModel, an EndpointSlice per engine) into `dir`.
    pub fn write_manifests(&self, dir: &Path) -> Result<PathBuf, SimError> {
        let path = dir.join("pool.yaml");
        let err = |source| SimError::Manifests {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(err)?;
        std::fs::write(&path, self.manifests()).map_err(err)?;
        Ok(path)
    }

    /// The manifests text.
    pub fn manifests(&self) -> String {
        self.manifests_of(|_| true)
    }

    /// The manifests text with only the engines `keep` accepts (the others have left the pool).
    pub fn manifests_of(&self, keep: impl Fn(&SimEngine) -> bool) -> String {
        let pool = &self.spec.pool_name;
        let model = &self.spec.params.model;
        let mut m = format!(
            "# Generated by `kvepp sim`: {n} simulated engines serving {model}.\n\
             apiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferencePool\n\
             metadata: {{name: {pool}}}\nspec:\n  targetPortNumber: 8000\n  selector: {{app: kvepp-sim}}\n  extensionRef: {{name: kvepp}}\n\
             ---\napiVersion: inference.networking.x-k8s.io/v1alpha2\nkind: InferenceModel\n\
             metadata: {{name: sim-model}}\nspec:\n  modelName: {model:?}\n  criticality: Standard\n  poolRef: {{name: {pool}}}\n",
            n = self.engines.len()
        );
        for e in self.engines.iter().filter(|e| keep(e)) {
            m += &format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n\
                 metadata: {{name: {name}, labels: {{kubernetes.io/service-name: {pool}}}}}\n\
                 addressType: IPv4\nendpoints:\n- addresses: [\"{ip}\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: {name}}}\n{topology}\
                 ports:\n- {{name: http, port: {port}, protocol: TCP}}\n- {{name: metadata, port: {port}, protocol: TCP}}\n",
                name = e.name,
                ip = e.http.ip(),
                port = e.http.port(),
                topology = ["zone", "host"]
                    .iter()
                    .zip(["zone", "nodeName"])
                    .filter_map(|(level, key)| Some(format!("  {key}: {:?}\n", e.layout.domains.get(*level)?)))
                    .collect::<String>(),
            );
        }
        m
    }
}

/// The engine's `/metadata` document (the selector's schema).
fn metadata(e: &SimEngine) -> serde_json::Value {
    let p = &e.core.params;
    serde_json::json!({
        "model": {"name": p.model, "type": "Completions", "runtime_config": {
            "block_size": p.block_size, "total_kv_blocks": p.total_kv_blocks,
            "max_num_seqs": p.max_num_seqs, "max_num_batched_tokens": p.max_num_batched_tokens,
            "data_parallel_size": 1}},
        "kv_events": {"endpoints": {"0": e.kv_events.endpoint},
                      "replay_endpoints": {"0": e.kv_events.replay_endpoint}},
        "role": e.layout.role.as_str(),
        "topology_domains": e.layout.domains,
    })
}

/// Flags of `kvepp sim`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// Number of engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Time model and sizes (YAML); see `--print-params` for the fields and defaults.
    #[arg(long)]
    pub params: Option<PathBuf>,
    /// Directory with the model's `tokenizer.json` (the one kvepp's `tokenizers` names).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Where to write the manifests `kvepp serve --manifests-dir` reads.
    #[arg(long, default_value = "sim-manifests")]
    pub manifests_dir: PathBuf,
    /// InferencePool name in the manifests.
    #[arg(long, default_value = "sim-pool")]
    pub pool_name: String,
    /// Address every engine binds (ephemeral ports).
    #[arg(long, default_value = "127.0.0.1")]
    pub bind_address: IpAddr,
    /// Each engine's own address instead, comma-separated (engine i binds the i-th), as pods
    /// have theirs.
    #[arg(long, value_delimiter = ',')]
    pub addresses: Vec<IpAddr>,
    /// Every engine's HTTP port, as a pool's target port (0: an ephemeral port each; a fixed
    /// port needs `--addresses`).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Print the default parameters as YAML and exit.
    #[arg(long)]
    pub print_params: bool,
    /// Disaggregated fleet: the first N engines prefill, the others decode (0: every engine
    /// does both).
    #[arg(long, default_value_t = 0)]
    pub prefill_engines: usize,
    /// Topology zones, comma-separated: engine i is in zone i mod n, on its own host.
    #[arg(long, value_delimiter = ',')]
    pub zones: Vec<String>,
}

impl SimArgs {
    pub fn spec(&self) -> Result<FleetSpec, SimError> {
        let params = match &self.params {
            Some(p) => SimParams::from_file(p)?,
            None => SimParams::default(),
        };
        Ok(FleetSpec {
            engines: self.engines,
            params,
            tokenizer: self.tokenizer.clone(),
            ip: self.bind_address,
            ips: self.addresses.clone(),
            port: self.port,
            pool_name: self.pool_name.clone(),
            layout: if self.prefill_engines > 0 || !self.zones.is_empty() {
                let prefill = self.prefill_engines.min(self.engines);
                let mut l =
                    EngineLayout::disaggregated(prefill, self.engines - prefill, &self.zones);
                if prefill == 0 {
                    l.iter_mut().for_each(|e| e.role = Role::Both);
                }
                l
            } else {
                Vec::new()
            },
        })
    }
}

/// Runs the fleet until `shutdown`, after printing where each engine listens.
pub async fn run(
    args: SimArgs,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), SimError> {
    let fleet = Fleet::start(args.spec()?).await?;
    let path = fleet.write_manifests(&args.manifests_dir)?;
    println!(
        "{} simulated engines serving {:?}; manifests in {}",
        fleet.engines.len(),
        fleet.spec.params.model,
        path.display()
    );
    for e in &fleet.engines {
        println!(
            "  {}  http://{}  kv-events {} (replay {})  role {}  {:?}",
            e.name,
            e.http,
            e.kv_events.endpoint,
            e.kv_events.replay_endpoint,
            e.layout.role.as_str(),
            e.layout.domains
        );
    }
    println!(
        "run: kvepp serve --manifests-dir {} --pool-name {}",
        args.manifests_dir.display(),
        fleet.spec.pool_name
    );
    shutdown.await;
    Ok(())
}
