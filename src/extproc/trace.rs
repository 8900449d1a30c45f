//! One trace span per routing decision (`kvepp.route`), a child of the request's W3C
//! `traceparent`/`tracestate` when the proxy passes them, with children for the stages that take
//! time (`kvepp.body`, `kvepp.tokenize`, `kvepp.queue`, `kvepp.pick`), and the route span's
//! context injected into the headers sent on to the engine so the engine's spans join the trace.
//!
//! Invariants: nothing here runs unless traces are on ([`TraceInfo`] present); a malformed or
//! absent `traceparent` starts a new root trace and never fails the request; the spans go only to
//! the OpenTelemetry layer (target [`TRACE_TARGET`]), never to the log.

use std::sync::Arc;
use std::time::Instant;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValueOption};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::routing::{Prepared, Rejection};
use crate::telemetry::TRACE_TARGET;
use kvepp_core::{Pick, Router};

/// What every request's span says about the picker serving it.
#[derive(Debug)]
pub struct TraceInfo {
    /// `namespace/name` of the InferencePool.
    pub pool: Arc<str>,
    /// The configured picker (`kv-aware`, `approximate-prefix`, …).
    pub picker: &'static str,
    /// The router, for its cost model now (reloads may change it).
    pub router: Arc<Router>,
}

/// The stages a decision's span has children for.
#[derive(Debug, Clone, Copy)]
pub(super) enum Stage {
    /// Parsing the body, tokenizing and hashing the prompt.
    Tokenize,
    /// Candidates, filters, cost, choice and booking.
    Pick,
}

/// The spans of one request.
#[derive(Debug)]
pub(super) struct RequestTrace {
    root: Span,
    body: Option<Span>,
    queue: Option<(Span, Instant)>,
}

/// The ext_proc request headers as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let h = self.0.headers.iter().find(|h| h.key == key)?;
        if h.raw_value.is_empty() {
            Some(h.value.as_str())
        } else {
            std::str::from_utf8(&h.raw_value).ok()
        }
    }

    fn keys(&self) -> Vec<&str> {
        self.0.headers.iter().map(|h| h.key.as_str()).collect()
    }
}

/// Headers to set on the request sent on to the engine.
struct Outgoing<'a>(&'a mut Vec<HeaderValueOption>);

impl Injector for Outgoing<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0
            .push(super::response::set_header(key, value.into_bytes()));
    }
}

impl RequestTrace {
    /// The decision's span, a child of the trace `headers` carry (a new root without one).
    pub(super) fn start(info: &TraceInfo, headers: Option<&HeaderMap>) -> Self {
        let root = tracing::info_span!(target: TRACE_TARGET, "kvepp.route");
        if let Some(h) = headers {
            let cx = TraceContextPropagator::new().extract(&Headers(h));
            // An invalid traceparent extracts to an empty context: a new root.
            let _ = root.set_parent(cx);
        }
        root.set_attribute("kvepp.pool", info.pool.to_string());
        root.set_attribute("kvepp.picker", info.picker);
        let cost = match info.router.cost_model() {
            Some(kvepp_core::cost::CostModel::Dynamo) => "dynamo",
            Some(kvepp_core::cost::CostModel::PredictedTtft) => "predicted-ttft",
            Some(kvepp_core::cost::CostModel::PredictedCompletion) => "predicted-completion",
            None => "none",
        };
        root.set_attribute("kvepp.cost_model", cost);
        RequestTrace {
            root,
            body: None,
            queue: None,
        }
    }

    /// The body is coming (until [`Self::body_done`]).
    pub(super) fn body_started(&mut self) {
        self.body =
            Some(tracing::info_span!(target: TRACE_TARGET, parent: &self.root, "kvepp.body"));
    }

    pub(super) fn body_done(&mut self) {
        self.body = None;
    }

    /// A child span for `stage`: it ends when dropped.
    pub(super) fn stage(&self, stage: Stage) -> Span {
        match stage {
            Stage::Tokenize => {
                tracing::info_span!(target: TRACE_TARGET, parent: &self.root, "kvepp.tokenize")
            }
            Stage::Pick => {
                tracing::info_span!(target: TRACE_TARGET, parent: &self.root, "kvepp.pick")
            }
        }
    }

    /// The request's facts: model, target model, objective and priority.
    pub(super) fn prepared(&self, p: &Prepared, objective: Option<&str>) {
        self.root
            .set_attribute("gen_ai.request.model", p.model_label.to_string());
        self.root
            .set_attribute("kvepp.target_model", p.target_label.to_string());
        if let Some(o) = objective {
            self.root.set_attribute("kvepp.objective", o.to_owned());
        }
        if let Some(r) = &p.rewritten_by {
            self.root
                .set_attribute("kvepp.model_rewrite", r.to_string());
        }
        self.root
            .set_attribute("kvepp.priority", i64::from(p.priority));
    }

    /// The request waits in flow control's queue (until [`Self::dequeued`]).
    pub(super) fn queued(&mut self) {
        if self.queue.is_none() {
            let span = tracing::info_span!(target: TRACE_TARGET, parent: &self.root, "kvepp.queue");
            self.queue = Some((span, Instant::now()));
        }
    }

    pub(super) fn dequeued(&mut self) {
        if let Some((_, since)) = self.queue.take() {
            let ms = since.elapsed().as_secs_f64() * 1000.0;
            self.root.set_attribute("kvepp.queue_wait_ms", ms);
        }
    }

    /// The decision: where, among how many, with how much cached.
    pub(super) fn routed(&self, pick: &Pick) {
        let r = &self.root;
        r.set_attribute("kvepp.outcome", "routed");
        r.set_attribute("kvepp.endpoint", pick.primary.addr_str.to_string());
        r.set_attribute("kvepp.candidates", i64::from(pick.candidates));
        if let Some(p) = &pick.pairing {
            r.set_attribute("kvepp.prefill_endpoint", p.prefill.addr_str.to_string());
        }
        if let Some(kv) = &pick.kv {
            r.set_attribute("kvepp.cached_blocks", kv.overlap.device as i64);
            r.set_attribute("kvepp.prompt_blocks", kv.prompt_blocks as i64);
        }
    }

    /// The request was answered by kvepp: its status and reason.
    pub(super) fn rejected(&self, r: &Rejection) {
        self.root
            .set_attribute("kvepp.outcome", r.status.to_string());
        self.root.set_attribute("kvepp.reason", r.reason);
        self.root
            .set_attribute("http.response.status_code", i64::from(r.status));
        if r.status >= 500 {
            self.root
                .set_status(opentelemetry::trace::Status::error(r.message.clone()));
        }
    }

    /// Adds `traceparent` (and `tracestate`) of the decision's span to `headers`.
    pub(super) fn inject(&self, headers: &mut Vec<HeaderValueOption>) {
        let cx = self.root.context();
        TraceContextPropagator::new().inject_context(&cx, &mut Outgoing(headers));
    }
}
