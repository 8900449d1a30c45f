//! Simulated inference engines, independent of kvepp itself: a fleet that serves the OpenAI API
//! with a prefix cache, a time model and vLLM's KV events and metrics ([`fleet`]); the simulator's
//! parameters measured on a real engine ([`calibrate`]); the workloads the benchmarks replay
//! ([`workload`]) and generated Mooncake-format traces ([`tracegen`]); a streaming OpenAI client
//! that times each request ([`client`]). The benchmarks that drive kvepp in front of this fleet
//! are the `kvepp-bench` crate's.

pub mod calibrate;
pub mod client;
pub mod fleet;
pub mod tracegen;
pub mod workload;

/// Logs to standard error at `warn` (or as `RUST_LOG` says): the setup of this crate's and the
/// benchmarks' binaries.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
