//! `kvepp-bench`: the benchmarks that run kvepp in front of the simulated fleet (routing quality,
//! adapters and sessions, the HTTP services, replica sync, rolling upgrades).

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kvepp-bench",
    version,
    about = "kvepp's benchmarks in front of the simulated fleet"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a workload through Envoy and kvepp to a simulated fleet under each routing policy
    /// and report TTFT, latency, throughput, prefix-cache hit ratio and load imbalance.
    #[command(name = "bench-routing")]
    Routing(Box<kvepp_bench::routing::BenchArgs>),
    /// Adapter affinity (least loaded, adapter-blind and adapter-aware KV-aware picking on a fleet
    /// with LoRA adapter slots) and session affinity (one and two replicas) through Envoy and kvepp.
    #[command(name = "bench-adapters")]
    Adapters(kvepp_bench::routing::affinity::AdapterBenchArgs),
    /// `/select_and_reserve` + free pairs per second over HTTP keep-alive against the same pick
    /// in-process (the selection service's HTTP overhead).
    #[command(name = "bench-select")]
    Select(kvepp_bench::select::SelectBenchArgs),
    /// Picks on one replica with 0 and 3 replica-sync peers publishing, and the event rate one
    /// replica absorbs while serving picks.
    #[command(name = "bench-replica")]
    Replica(kvepp_bench::replica::ReplicaBenchArgs),
    /// A rolling upgrade of two `kvepp serve` processes behind Envoy under steady load: failed
    /// requests, the longest stall, and the prefix hit ratio before and after.
    #[command(name = "bench-rollout")]
    Rollout(kvepp_bench::rollout::RolloutArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    kvepp_sim::init_logging();
    match cli.command {
        Command::Routing(args) => {
            kvepp_bench::routing::run(*args).await?;
        }
        Command::Adapters(args) => {
            kvepp_bench::routing::affinity::run(args).await?;
        }
        Command::Select(args) => {
            kvepp_bench::select::run(args).await?;
        }
        Command::Replica(args) => {
            kvepp_bench::replica::run(args).await?;
        }
        Command::Rollout(args) => {
            kvepp_bench::rollout::run(args).await?;
        }
    }
    Ok(())
}
