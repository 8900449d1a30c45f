//! `kvepp` command line.

use clap::{Parser, Subcommand};
use kvepp::config::{Config, ServeArgs};
use kvepp::process::{init_logging, shutdown_signal, LogFormat};
use kvepp::services::{SelectArgs, SlotTrackerArgs};

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
    /// probe `/health` (the same as the `kvepp-agent` binary).
    WorkerAgent(kvepp::agent::AgentArgs),
    /// Dynamo-compatible standalone selection service over HTTP (workers, selection,
    /// reservations, loads).
    SelectService(SelectArgs),
    /// Dynamo-compatible standalone slot tracker over HTTP (active-request load accounting).
    SlotTracker(SlotTrackerArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Command::SelectService(a) = &cli.command {
        rt.worker_threads(a.threads.max(1));
    }
    rt.build()?.block_on(run(cli.command))
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => {
            let cfg = Config::load(&args)?;
            init_logging(cfg.log_format, &cfg.log_level);
            tracing::info!(version = env!("CARGO_PKG_VERSION"), commit = env!("KVEPP_GIT_SHA"), config = %serde_json::to_string(&cfg)?, "configuration");
            let listeners = kvepp::server::Listeners::bind(&cfg).await?;
            kvepp::server::run(cfg, listeners, shutdown_signal()).await?;
        }
        Command::WorkerAgent(args) => kvepp::agent::main(args).await?,
        Command::Config(args) => {
            let cfg = Config::load(&args)?;
            print!("{}", serde_yaml::to_string(&cfg)?);
        }
        Command::SelectService(args) => {
            init_logging(LogFormat::Text, &log_level());
            kvepp::services::select_peers(&args)?;
            let listener = kvepp::services::bind(args.host, args.port).await?;
            kvepp::services::run_select(args, listener, shutdown_signal()).await?;
        }
        Command::SlotTracker(args) => {
            init_logging(LogFormat::Text, &log_level());
            kvepp::services::slot_tracker_peers(&args)?;
            let listener = kvepp::services::bind(args.host, args.port).await?;
            kvepp::services::run_slot_tracker(args, listener, shutdown_signal()).await?;
        }
    }
    Ok(())
}

/// The standalone services' log filter: `RUST_LOG`, else `info`.
fn log_level() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into())
}
