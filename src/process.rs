//! Process plumbing shared by the `kvepp` and `kvepp-agent` binaries: logging setup (with the
//! handle that changes the log level live) and the shutdown signal. Owns nothing else; called
//! once at start.

use serde::{Deserialize, Serialize};

/// How log lines are written.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    Text,
    Json,
}

type FilterHandle =
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>;

/// Changes the log filter of the subscriber [`init_logging`] installed.
#[derive(Clone)]
pub struct LogLevel {
    handle: FilterHandle,
    /// `RUST_LOG` was set at start: it keeps winning over the configuration.
    from_env: bool,
}

impl std::fmt::Debug for LogLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogLevel")
            .field("from_env", &self.from_env)
            .finish()
    }
}

impl LogLevel {
    /// Log lines from now on pass `level` (a tracing filter such as `info` or `kvepp=debug`);
    /// Ok(false) when `RUST_LOG` set the filter and keeps it.
    pub(crate) fn set(&self, level: &str) -> Result<bool, String> {
        if self.from_env {
            return Ok(false);
        }
        self.handle
            .reload(log_filter(level)?)
            .map_err(|e| e.to_string())?;
        Ok(true)
    }
}

/// The log filter `level` names, without kvepp's trace spans (those go only to the trace
/// exporter).
fn log_filter(level: &str) -> Result<tracing_subscriber::EnvFilter, String> {
    let f = tracing_subscriber::EnvFilter::try_new(level).map_err(|e| e.to_string())?;
    Ok(without_trace_spans(f))
}

fn without_trace_spans(f: tracing_subscriber::EnvFilter) -> tracing_subscriber::EnvFilter {
    match format!("{}=off", crate::telemetry::TRACE_TARGET).parse() {
        Ok(d) => f.add_directive(d),
        Err(_) => f,
    }
}

/// Installs the global tracing subscriber: log lines on stderr (`RUST_LOG`, when set, wins over
/// `level`) and, with `tracer`, kvepp's trace spans to OpenTelemetry.
pub fn init_logging(
    format: LogFormat,
    level: &str,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
) -> LogLevel {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let env = tracing_subscriber::EnvFilter::try_from_default_env().ok();
    let from_env = env.is_some();
    let filter = match env {
        Some(f) => without_trace_spans(f),
        None => log_filter(level).unwrap_or_else(|_| without_trace_spans("info".into())),
    };
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    let traces = tracer.map(|t| {
        tracing_opentelemetry::layer().with_tracer(t).with_filter(
            tracing_subscriber::filter::filter_fn(|m| m.target() == crate::telemetry::TRACE_TARGET),
        )
    });
    // Only the first subscriber is installed (a second call, as in tests, keeps it).
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(traces)
        .try_init();
    LogLevel { handle, from_env }
}

/// Completes on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
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
