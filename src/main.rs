//! `kvepp` command line.

use clap::{Parser, Subcommand};
use kvepp::config::{Config, ServeArgs};
use kvepp::process::{init_logging, shutdown_signal};

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
        Command::WorkerAgent(args) => kvepp::agent::main(args).await?,
        Command::Config(args) => {
            let cfg = Config::load(&args)?;
            print!("{}", serde_yaml::to_string(&cfg)?);
        }
    }
    Ok(())
}
