//! `kvepp-sim`: the simulated fleet, its calibration on a real engine, generated traces and the
//! decisions demo's echo backend. It links no part of kvepp's server (`kvepp-bench` runs the
//! benchmarks that drive both).

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "kvepp-sim",
    version,
    about = "Simulated inference engines for kvepp's tests and benchmarks"
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
            kvepp_sim::init_logging();
            kvepp_sim::fleet::run(args, shutdown_signal()).await?;
        }
        Command::GenTrace(args) => kvepp_sim::tracegen::run(&args)?,
        Command::Calibrate(args) => kvepp_sim::calibrate::run(&args).await?,
        Command::EchoBackend { listen, name } => {
            kvepp_sim::init_logging();
            let l = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("bind {listen}"))?;
            kvepp_test_support::serve_echo_backend(l, name).await?;
        }
    }
    Ok(())
}
