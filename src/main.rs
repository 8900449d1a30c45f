//! `kvepp` command line.

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kvepp::config::{Config, LogFormat, ServeArgs};

#[derive(Debug, Parser)]
#[command(name = "kvepp", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("KVEPP_GIT_SHA"), ")"), about = "KV-cache-aware Endpoint Picker for LLM inference behind Envoy (ext_proc)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the Endpoint Picker (ext_proc gRPC, gRPC health, Prometheus metrics).
    Serve(ServeArgs),
    /// Print the effective configuration (defaults ← file ← env ← flags) as YAML and exit.
    Config(ServeArgs),
    /// Sidecar beside a model server: registers the pod, serves `/metadata` and the readiness
    /// probe `/health`.
    WorkerAgent(kvepp::replica::AgentArgs),
    /// Simulated inference engines (OpenAI API, prefix cache, time model, vLLM KV events and
    /// metrics) on 127.0.0.1, listed in a manifests directory `kvepp serve` reads.
    Sim(kvepp::sim::SimArgs),
    /// Replay a workload through Envoy and kvepp to a simulated fleet under each routing policy
    /// and report TTFT, latency, throughput, prefix-cache hit ratio and load imbalance.
    BenchRouting(kvepp::routing_bench::BenchArgs),
    /// A tiny HTTP backend that answers with what it received (for the local demo).
    #[command(hide = true)]
    EchoBackend {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        name: String,
    },
}

fn init_logging(format: LogFormat, level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(%e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Serve(args) => {
            let cfg = Config::load(&args)?;
            init_logging(cfg.log_format, &cfg.log_level);
            tracing::info!(version = env!("CARGO_PKG_VERSION"), commit = env!("KVEPP_GIT_SHA"), config = %serde_json::to_string(&cfg)?, "configuration");
            let listeners = kvepp::server::Listeners::bind(&cfg).await?;
            kvepp::server::run(cfg, listeners, shutdown_signal()).await?;
        }
        Command::WorkerAgent(args) => {
            init_logging(LogFormat::Text, "info");
            let l = tokio::net::TcpListener::bind(args.listen)
                .await
                .with_context(|| format!("bind {}", args.listen))?;
            kvepp::replica::run(args, l, shutdown_signal()).await?;
        }
        Command::Sim(args) => {
            if args.print_params {
                print!(
                    "{}",
                    serde_yaml::to_string(&kvepp::sim::SimParams::default())?
                );
                return Ok(());
            }
            init_logging(LogFormat::Text, "warn");
            kvepp::sim::run(args, shutdown_signal()).await?;
        }
        Command::BenchRouting(args) => {
            init_logging(LogFormat::Text, "warn");
            kvepp::routing_bench::run(args).await?;
        }
        Command::Config(args) => {
            let cfg = Config::load(&args)?;
            print!("{}", serde_yaml::to_string(&cfg)?);
        }
        Command::EchoBackend { listen, name } => {
            init_logging(LogFormat::Text, "warn");
            let l = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("bind {listen}"))?;
            kvepp::testing::serve_echo_backend(l, name).await?;
        }
    }
    Ok(())
}
