//! `kvepp-agent`: the worker-agent sidecar beside a model server. It registers the pod, serves
//! `/metadata` and the readiness probe `/health` (see `kvepp::agent`).

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "kvepp-agent", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("KVEPP_GIT_SHA"), ")"), about = "Worker-agent sidecar beside a model server (registration, /metadata, /health)")]
struct Cli {
    #[command(flatten)]
    args: kvepp::agent::AgentArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Cli::parse().args;
    // With a configuration file, its `worker_agent` section under the flags.
    let args = match &args.config {
        Some(_) => kvepp::config::agent::agent_args(std::env::args_os().skip(1).collect())?,
        None => args,
    };
    kvepp::agent::main(args).await?;
    Ok(())
}
