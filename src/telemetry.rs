//! OpenTelemetry traces: the `tracing` section of the configuration, the OTLP exporter pipeline
//! behind `tracing-opentelemetry`, and its counters.
//!
//! Owns: the tracer provider (one per process, started by the binary before logging is set up)
//! and the bound on spans waiting for export. Invariants: off unless an OTLP endpoint is set;
//! routing never waits on the exporter — a finished span is queued without blocking and, when
//! [`TracingConfig::max_queue_size`] spans already wait, dropped and counted
//! (`kvepp_trace_spans_dropped_total{reason="queue_full"}`); a batch the collector does not take
//! is dropped and counted (`reason="export_failed"`). Exports run on the process's own Tokio
//! runtime (the SDK's batch thread waits for them), which the gRPC and HTTP clients need.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter,
    SpanProcessor,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::metrics::{ReasonLabels, Register};

/// The `tracing` target of kvepp's trace spans: only the OpenTelemetry layer reads it.
pub(crate) const TRACE_TARGET: &str = "kvepp::trace";

/// How spans reach the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum OtlpProtocol {
    /// OTLP over gRPC (the collector's port 4317).
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP over HTTP with protobuf bodies (port 4318, path `/v1/traces`).
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

/// The `tracing` section: where and how spans are exported. The OpenTelemetry variables
/// (`OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`, `_PROTOCOL`, `_TIMEOUT`, `OTEL_SERVICE_NAME`,
/// `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`, `OTEL_BSP_MAX_QUEUE_SIZE`,
/// `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_SDK_DISABLED`) override the file, as kvepp's other variables
/// do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TracingConfig {
    /// The collector, e.g. `http://otel-collector:4317` (gRPC) or `http://otel-collector:4318`
    /// (HTTP; `/v1/traces` is added to a URL without a path). Unset: no traces.
    pub otlp_endpoint: Option<String>,
    /// OTLP transport: `grpc` or `http/protobuf`.
    pub protocol: OtlpProtocol,
    /// `service.name` of kvepp's spans.
    pub service_name: String,
    /// `always_on`, `always_off`, `traceidratio`, `parentbased_always_on`,
    /// `parentbased_always_off` or `parentbased_traceidratio` (OpenTelemetry's names).
    pub sampler: String,
    /// The ratio of the `*traceidratio` samplers (0-1).
    pub sampler_arg: f64,
    /// Finished spans waiting for export at most; more are dropped and counted.
    pub max_queue_size: usize,
    /// How often a batch is sent, in milliseconds.
    pub schedule_delay_ms: u64,
    /// Longest wait for the collector to take a batch, in milliseconds.
    pub export_timeout_ms: u64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            protocol: OtlpProtocol::Grpc,
            service_name: "kvepp".into(),
            sampler: "parentbased_always_on".into(),
            sampler_arg: 1.0,
            max_queue_size: 2048,
            schedule_delay_ms: 5000,
            export_timeout_ms: 10_000,
        }
    }
}

const SAMPLERS: [&str; 6] = [
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
];

impl TracingConfig {
    /// Applies the OpenTelemetry variables `env` reads; a value that does not parse is named in
    /// the returned messages (field, message).
    pub(crate) fn apply_env(
        &mut self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Vec<(&'static str, String)> {
        let mut bad = Vec::new();
        if env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            self.otlp_endpoint = None;
            return bad;
        }
        if let Some(p) =
            env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"))
        {
            match p.as_str() {
                "grpc" => self.protocol = OtlpProtocol::Grpc,
                "http/protobuf" => self.protocol = OtlpProtocol::HttpProtobuf,
                other => bad.push((
                    "tracing.protocol",
                    format!("OTEL_EXPORTER_OTLP_PROTOCOL {other:?}: grpc or http/protobuf"),
                )),
            }
        }
        if let Some(e) = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            self.otlp_endpoint = Some(e);
        } else if let Some(e) = env("OTEL_EXPORTER_OTLP_ENDPOINT") {
            // The generic variable is a base URL: the signal's path goes after it over HTTP.
            self.otlp_endpoint = Some(match self.protocol {
                OtlpProtocol::HttpProtobuf => format!("{}/v1/traces", e.trim_end_matches('/')),
                OtlpProtocol::Grpc => e,
            });
        }
        if let Some(s) = env("OTEL_SERVICE_NAME") {
            self.service_name = s;
        }
        if let Some(s) = env("OTEL_TRACES_SAMPLER") {
            self.sampler = s;
        }
        let mut number = |var: &'static str, field: &'static str| {
            let v = env(var)?;
            match v.trim().parse::<f64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    bad.push((field, format!("{var} {v:?} is not a number")));
                    None
                }
            }
        };
        if let Some(a) = number("OTEL_TRACES_SAMPLER_ARG", "tracing.sampler_arg") {
            self.sampler_arg = a;
        }
        if let Some(n) = number("OTEL_BSP_MAX_QUEUE_SIZE", "tracing.max_queue_size") {
            self.max_queue_size = n as usize;
        }
        if let Some(n) = number("OTEL_BSP_SCHEDULE_DELAY", "tracing.schedule_delay_ms") {
            self.schedule_delay_ms = n as u64;
        }
        if let Some(n) = number("OTEL_EXPORTER_OTLP_TIMEOUT", "tracing.export_timeout_ms") {
            self.export_timeout_ms = n as u64;
        }
        bad
    }

    /// One message per bad field.
    pub(crate) fn problems(&self, bad: &mut impl FnMut(&'static str, String)) {
        if !SAMPLERS.contains(&self.sampler.as_str()) {
            bad(
                "tracing.sampler",
                format!("{:?} is not one of {}", self.sampler, SAMPLERS.join(", ")),
            );
        }
        if !(0.0..=1.0).contains(&self.sampler_arg) {
            bad(
                "tracing.sampler_arg",
                format!("{} must be between 0 and 1", self.sampler_arg),
            );
        }
        if self.max_queue_size == 0 {
            bad("tracing.max_queue_size", "must be at least 1".into());
        }
        if self.schedule_delay_ms == 0 || self.export_timeout_ms == 0 {
            bad(
                "tracing.schedule_delay_ms",
                "schedule_delay_ms and export_timeout_ms must be at least 1".into(),
            );
        }
        if let Some(e) = &self.otlp_endpoint {
            match e.parse::<http::Uri>() {
                Ok(u) if u.scheme_str() == Some("http") && u.host().is_some() => {}
                Ok(u) if u.scheme_str() == Some("https") => bad(
                    "tracing.otlp_endpoint",
                    format!("{e}: https collectors are not supported; use a plaintext endpoint (a node-local or sidecar collector)"),
                ),
                _ => bad(
                    "tracing.otlp_endpoint",
                    format!("{e:?} is not an http:// URL with a host"),
                ),
            }
        }
        if self.service_name.is_empty() {
            bad("tracing.service_name", "must not be empty".into());
        }
    }

    fn sampler(&self) -> Sampler {
        let ratio = Sampler::TraceIdRatioBased(self.sampler_arg);
        match self.sampler.as_str() {
            "always_on" => Sampler::AlwaysOn,
            "always_off" => Sampler::AlwaysOff,
            "traceidratio" => ratio,
            "parentbased_always_off" => Sampler::ParentBased(Box::new(Sampler::AlwaysOff)),
            "parentbased_traceidratio" => Sampler::ParentBased(Box::new(ratio)),
            _ => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
        }
    }
}

/// `kvepp_trace_spans_exported_total` and `kvepp_trace_spans_dropped_total{reason}`.
#[derive(Debug, Clone, Default)]
pub struct TraceMetrics {
    /// Spans the collector took.
    pub exported: Counter,
    /// Spans dropped, by reason (`queue_full`, `export_failed`).
    pub dropped: Family<ReasonLabels, Counter>,
}

impl TraceMetrics {
    fn dropped(&self, reason: &'static str, n: usize) {
        self.dropped
            .get_or_create(&ReasonLabels { reason })
            .inc_by(n as u64);
    }
}

impl Register for TraceMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "trace_spans_exported",
            "Spans the OTLP collector took",
            self.exported.clone(),
        );
        registry.register(
            "trace_spans_dropped",
            "Spans not exported, by reason: queue_full (the collector is slower than the spans come), export_failed (the collector did not take the batch)",
            self.dropped.clone(),
        );
    }
}

#[derive(Debug, thiserror::Error)]
#[error("OTLP trace exporter: {0}")]
pub struct TelemetryError(String);

/// The running trace pipeline.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    pub metrics: TraceMetrics,
}

impl Telemetry {
    /// Starts exporting as `cfg` says (None: no endpoint, no traces). Call inside the Tokio
    /// runtime the exports will run on.
    pub fn start(cfg: &TracingConfig) -> Result<Option<Telemetry>, TelemetryError> {
        let Some(endpoint) = &cfg.otlp_endpoint else {
            return Ok(None);
        };
        let timeout = Duration::from_millis(cfg.export_timeout_ms);
        let exporter = match cfg.protocol {
            OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(timeout)
                .build(),
            OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_http_client(
                    opentelemetry_http::hyper::HyperClient::with_default_connector(timeout, None),
                )
                .with_endpoint(http_endpoint(endpoint))
                .with_timeout(timeout)
                .build(),
        }
        .map_err(|e| TelemetryError(e.to_string()))?;
        let metrics = TraceMetrics::default();
        let pending = Arc::new(AtomicUsize::new(0));
        let bridge = OnRuntime {
            inner: Arc::new(exporter),
            runtime: tokio::runtime::Handle::current(),
            pending: pending.clone(),
            metrics: metrics.clone(),
        };
        // The SDK's own queue is never the one that fills: ours counts what it drops.
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(cfg.max_queue_size.saturating_add(512))
            .with_scheduled_delay(Duration::from_millis(cfg.schedule_delay_ms))
            .build();
        let processor = Bounded {
            inner: BatchSpanProcessor::builder(bridge)
                .with_batch_config(batch)
                .build(),
            pending,
            cap: cfg.max_queue_size,
            metrics: metrics.clone(),
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(cfg.sampler())
            .with_resource(
                opentelemetry_sdk::Resource::builder()
                    .with_service_name(cfg.service_name.clone())
                    .build(),
            )
            .build();
        tracing::info!(endpoint = %endpoint, protocol = ?cfg.protocol, sampler = %cfg.sampler, "exporting traces over OTLP");
        Ok(Some(Telemetry { provider, metrics }))
    }

    /// The tracer `tracing-opentelemetry` records kvepp's spans with.
    pub fn tracer(&self) -> opentelemetry_sdk::trace::Tracer {
        self.provider.tracer("kvepp")
    }

    /// Sends what is queued (bounded by the export timeout) and stops.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = provider.shutdown_with_timeout(Duration::from_secs(5)) {
                tracing::warn!(error = %e, "trace exporter shutdown");
            }
        })
        .await;
    }
}

/// The endpoint of an HTTP collector: a URL without a path gets the traces path.
fn http_endpoint(e: &str) -> String {
    match e.parse::<http::Uri>() {
        Ok(u) if u.path() == "/" || u.path().is_empty() => {
            format!("{}/v1/traces", e.trim_end_matches('/'))
        }
        _ => e.to_owned(),
    }
}

/// The SDK's batch processor behind a bound of our own: a span beyond `cap` waiting is dropped
/// and counted instead of queued.
#[derive(Debug)]
struct Bounded {
    inner: BatchSpanProcessor,
    pending: Arc<AtomicUsize>,
    cap: usize,
    metrics: TraceMetrics,
}

impl SpanProcessor for Bounded {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.pending.fetch_add(1, Ordering::AcqRel) >= self.cap {
            self.pending.fetch_sub(1, Ordering::AcqRel);
            self.metrics.dropped("queue_full", 1);
            return;
        }
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter run on the process's Tokio runtime (the SDK's batch thread is not a Tokio
/// thread), counting what it sends and what fails.
#[derive(Debug)]
struct OnRuntime {
    inner: Arc<opentelemetry_otlp::SpanExporter>,
    runtime: tokio::runtime::Handle,
    pending: Arc<AtomicUsize>,
    metrics: TraceMetrics,
}

impl SpanExporter for OnRuntime {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = batch.len();
        let inner = self.inner.clone();
        let result = self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await;
        self.pending.fetch_sub(n, Ordering::AcqRel);
        match result {
            Ok(Ok(())) => {
                self.metrics.exported.inc_by(n as u64);
                Ok(())
            }
            Ok(Err(e)) => {
                self.metrics.dropped("export_failed", n);
                tracing::debug!(error = %e, spans = n, "trace export failed");
                Err(e)
            }
            Err(e) => {
                self.metrics.dropped("export_failed", n);
                Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    e.to_string(),
                ))
            }
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        // Called once while the provider is built, before any export shares the exporter.
        if let Some(e) = Arc::get_mut(&mut self.inner) {
            e.set_resource(resource);
        }
    }
}
