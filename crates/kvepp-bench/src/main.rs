//! `kvepp-sim`: the simulated fleet, the routing-quality benchmark and the demo's echo backend.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kvepp-sim",
    version,
    about = "Simulated inference engines and the routing-quality benchmark for kvepp"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Simulated inference engines (OpenAI API, prefix cache, time model, vLLM KV events and
    /// metrics) on 127.0.0.1, listed in a manifests directory `kvepp serve` reads.
    Fleet(kvepp_sim::fleet::SimArgs),
    /// Replay a workload through Envoy and kvepp to a simulated fleet under each routing policy
    /// and report TTFT, latency, throughput, prefix-cache hit ratio and load imbalance.
    BenchRouting(kvepp_bench::routing::BenchArgs),
    /// Adapter affinity (least loaded, adapter-blind and adapter-aware KV-aware picking on a fleet
    /// with LoRA adapter slots) and session affinity (one and two replicas) through Envoy and kvepp.
    BenchAdapters(kvepp_bench::routing::affinity::AdapterBenchArgs),
    /// `/select_and_reserve` + free pairs per second over HTTP keep-alive against the same pick
    /// in-process (the selection service's HTTP overhead).
    BenchSelect(kvepp_bench::select::SelectBenchArgs),
    /// Picks on one replica with 0 and 3 replica-sync peers publishing, and the event rate one
    /// replica absorbs while serving picks.
    BenchReplica(kvepp_bench::replica::ReplicaBenchArgs),
    /// A rolling upgrade of two `kvepp serve` processes behind Envoy under steady load: failed
    /// requests, the longest stall, and the prefix hit ratio before and after.
    BenchRollout(kvepp_bench::rollout::RolloutArgs),
    /// Write a generated request trace in the Mooncake format (seeded arrivals with bursts,
    /// log-normal lengths, shared system prompts or multi-turn conversations).
    GenTrace(kvepp_sim::tracegen::GenTraceArgs),
    /// Measure a real engine (vLLM's OpenAI server) and write the simulator's parameters for it:
    /// prefill time per token, the cached path, decode step time against batch size and context,
    /// block size and KV capacity.
    Calibrate(kvepp_sim::calibrate::CalibrateArgs),
    /// A tiny HTTP backend that answers with what it received (the decisions demo's model server).
    EchoBackend {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

async fn shutdown_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(%e, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Fleet(args) => {
            if args.print_params {
                print!(
                    "{}",
                    serde_yaml::to_string(&kvepp_sim::fleet::SimParams::default())?
                );
                return Ok(());
            }
            init_logging();
            kvepp_sim::fleet::run(args, shutdown_signal()).await?;
        }
        Command::BenchReplica(args) => {
            init_logging();
            kvepp_bench::replica::run(args).await?;
        }
        Command::BenchSelect(args) => {
            init_logging();
            kvepp_bench::select::run(args).await?;
        }
        Command::BenchAdapters(args) => {
            init_logging();
            kvepp_bench::routing::affinity::run(args).await?;
        }
        Command::BenchRollout(args) => {
            init_logging();
            kvepp_bench::rollout::run(args).await?;
        }
        Command::GenTrace(args) => kvepp_sim::tracegen::run(&args)?,
        Command::Calibrate(args) => kvepp_sim::calibrate::run(&args).await?,
        Command::BenchRouting(args) => {
            init_logging();
            kvepp_bench::routing::run(args).await?;
        }
        Command::EchoBackend { listen, name } => {
            init_logging();
            let l = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("bind {listen}"))?;
            kvepp_test_support::serve_echo_backend(l, name).await?;
        }
    }
    Ok(())
}
