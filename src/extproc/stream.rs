//! The state machine of one ext_proc stream (= one HTTP request).
//!
//! Request side, by Envoy's `request_body_mode` (announced in `protocol_config`):
//! - no body (headers with end_of_stream) or `NONE`: pick at the headers, without a model;
//! - `BUFFERED`: continue the headers, pick when the whole body arrives, answer in the body
//!   response (Envoy applies header mutations there because the headers are still held);
//! - `FULL_DUPLEX_STREAMED`: hold the headers answer, collect chunks until end_of_stream (or
//!   trailers), then send the headers answer followed by the body as streamed chunks.
//!
//! A complete request is prepared once (its facts: model, priority, prompt blocks), then admitted,
//! then decided. With flow control, a request that arrives while others wait, or finds every
//! eligible endpoint saturated, is held (phase `Queued`, its facts and its body kept as they came)
//! until the stream's driver gets it a turn and calls [`StreamState::retry`], which decides from
//! the same facts, or gives up ([`StreamState::give_up`]).
//!
//! Response side: the first response byte ends the prefill phase of the booking; an event
//! stream's first chunk is its first token and its end (with the output tokens counted on the way,
//! [`super::output`]) the end of its decode, which the booking's predictions learn from; end of
//! stream, trailers or the stream going away (abort) release it. The booking is released by `Drop`, so
//! every path releases it exactly once; its release tells the router's listeners (flow control's
//! dispatcher among them).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};

use super::wire::{
    processing_request::Request as Msg, HttpBody, HttpHeaders, ProcessingRequest,
    ProcessingResponse,
};

use super::metadata::{served_endpoint, subset_hint, Subset};
use super::output::OutputTokens;
use super::response as resp;
use super::slo::Objectives;
use super::trace::{RequestTrace, Stage};
use super::Shared;
use crate::metrics::{Outcome, ReasonLabels, RequestLabels, RewriteLabels};
use crate::routing::{Objective, Prepared, Rejection, RequestHead, RouteHints, Verdict};
use kvepp_core::affinity::SessionKey;
use kvepp_core::Admission;
use kvepp_core::{Booking, Pick};
use kvepp_request::Rewrite;

/// Request headers naming the InferenceObjective (llm-d's current name first, then the Inference
/// Extension's former one).
pub(crate) const OBJECTIVE_HEADERS: [&str; 2] = [
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
];

/// Envoy's BodySendMode values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    None,
    Buffered,
    /// BUFFERED_PARTIAL: like BUFFERED while the body fits the proxy's buffer.
    BufferedPartial,
    Duplex,
    Unsupported(i32),
}

impl Mode {
    fn from_i32(v: i32) -> Mode {
        match v {
            0 => Mode::None,
            2 => Mode::Buffered,
            3 => Mode::BufferedPartial,
            4 => Mode::Duplex,
            other => Mode::Unsupported(other),
        }
    }
}

#[derive(Debug)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Headers answered; the buffered body comes next.
    BufferedBody,
    /// Collecting streamed chunks; the headers answer is held until the body is complete.
    DuplexBody(Chunks),
    /// Complete, waiting in flow control's queue for capacity.
    Queued(Held),
    /// Forwarded to the picked endpoint; watching the response.
    Routed(Routed),
    /// An immediate response was sent; nothing more is forwarded.
    Rejected,
}

/// A streamed body so far: slices of the gRPC messages it came in, and their total length.
#[derive(Debug, Default)]
struct Chunks {
    chunks: Vec<Bytes>,
    len: usize,
}

/// A complete request not yet routed: its body as it came, how it is answered, its facts.
#[derive(Debug)]
struct Held {
    chunks: Vec<Bytes>,
    /// One copy of a body that came in several chunks (made once, kept while queued).
    joined: Option<Bytes>,
    shape: BodyShape,
    prepared: Prepared,
    /// When the request was complete (its TTFT objective counts from here).
    arrived: Instant,
    /// Its last decision found no endpoint within this objective (it waits behind the others).
    unfit: Option<Objective>,
    /// Counted as waiting for the pool's first ready endpoint (scale from zero), while it is.
    endpoint_wait: Option<crate::admission::flow::EndpointWait>,
}

/// A routed request: its booking (released when the response ends), where it went, and whether
/// its first token is still to come.
#[derive(Debug)]
struct Routed {
    booking: Option<Booking>,
    primary: std::net::SocketAddr,
    /// A 200 event stream is coming back: its first body chunk is the first token.
    awaiting_first_token: bool,
    /// An event stream's output tokens so far (None: not an event stream).
    output: Option<OutputTokens>,
    /// The InferenceModelRewrite that chose the target model, and the target, when one did.
    rewritten: Option<RewriteLabels>,
}

/// Which answer a complete request gets once it is decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyShape {
    /// Decided at the headers (no body).
    Headers,
    /// The whole body in one BUFFERED message (the held chunks are it).
    Buffered,
    /// Streamed chunks; `trailers`: the request ended with trailers.
    Duplex { trailers: bool },
}

/// A routing decision for a request.
struct Decision {
    pick: Pick,
    /// Where the `model` value is and what it becomes, when the body must be rewritten.
    rewrite: Option<(Range<usize>, Arc<str>)>,
}

pub(super) struct StreamState {
    shared: Arc<Shared>,
    request_mode: Mode,
    response_mode: Mode,
    /// Where the stream is; what is valid only in one phase is that phase's.
    phase: Phase,
    // What the request headers said (read once, valid from then on).
    subset: Subset,
    /// The InferenceObjective header's value, when sent.
    objective: Option<String>,
    /// The request's `:path`, when sent (it names the body's format).
    path: Option<String>,
    /// The fairness header's value (flow control), when sent.
    flow: Option<String>,
    /// The session header's value as a key, when sent and usable.
    session: Option<kvepp_core::affinity::SessionKey>,
    /// The request's own latency objectives (its `x-slo-*` headers).
    slo: Objectives,
    /// The decision's trace spans, when traces are on (ended once the request is answered).
    trace: Option<RequestTrace>,
    /// The request's metric labels, once decided or answered (counted when the stream ends).
    labels: Option<RequestLabels>,
}

impl StreamState {
    pub(super) fn new(shared: Arc<Shared>) -> Self {
        StreamState {
            shared,
            request_mode: Mode::Buffered,
            response_mode: Mode::None,
            phase: Phase::Start,
            subset: Subset::Unset,
            objective: None,
            path: None,
            flow: None,
            session: None,
            slo: Objectives::default(),
            trace: None,
            labels: None,
        }
    }

    pub(super) fn handle(&mut self, msg: ProcessingRequest, out: &mut Vec<ProcessingResponse>) {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode = Mode::from_i32(pc.request_body_mode);
            self.response_mode = Mode::from_i32(pc.response_body_mode);
        }
        let Some(request) = msg.request else { return };
        match request {
            Msg::RequestHeaders(h) => {
                self.subset = subset_hint(msg.metadata_context.as_ref());
                self.on_request_headers(h, out)
            }
            Msg::RequestBody(b) => self.on_request_body(b, out),
            Msg::RequestTrailers(_) => match self.phase {
                Phase::DuplexBody(_) => self.finish_duplex(true, out),
                Phase::Rejected => {}
                _ => out.push(resp::trailers_continue(true)),
            },
            Msg::ResponseHeaders(h) => {
                self.on_response_headers(&h, served_endpoint(msg.metadata_context.as_ref()));
                out.push(resp::response_headers_continue());
                if h.end_of_stream {
                    self.release();
                }
            }
            Msg::ResponseBody(b) => {
                if let Phase::Routed(r) = &mut self.phase {
                    r.first_byte();
                    if r.awaiting_first_token && !b.body.is_empty() {
                        r.awaiting_first_token = false;
                        if let Some(booking) = &mut r.booking {
                            booking.first_token(std::time::Instant::now());
                        }
                    }
                    if let Some(o) = &mut r.output {
                        o.read(&b.body);
                    }
                }
                let eos = b.end_of_stream;
                out.push(match self.response_mode {
                    Mode::Duplex => resp::response_body_chunk(b.body, eos),
                    _ => resp::response_body_continue(),
                });
                if eos {
                    self.release();
                }
            }
            Msg::ResponseTrailers(_) => {
                self.release();
                out.push(resp::trailers_continue(false));
            }
        }
    }

    /// Releases the booking (if any); its drop tells the router's listeners (flow control's
    /// dispatcher among them). An event stream that ended (`ended`: its last chunk or trailers
    /// came, not an abort) teaches the booking's decode prediction first.
    fn release_at_end(&mut self, ended: bool) {
        if let Phase::Routed(r) = &mut self.phase {
            if let (true, Some(b), Some(o)) = (ended, &mut r.booking, &r.output) {
                b.finished(Instant::now(), o.count());
            }
            r.booking = None;
        }
    }

    /// The response ended: [`Self::release_at_end`].
    fn release(&mut self) {
        self.release_at_end(true);
    }

    /// Reads the headers kvepp routes on: the objective, the latency objectives and, with flow
    /// control, the flow. Err: an `x-slo-*` header's value is not an objective (the message).
    fn read_headers(&mut self, h: &HttpHeaders) -> Result<(), String> {
        let Some(map) = &h.headers else {
            return Ok(());
        };
        // The fairness id names the flow (flow control) and keys weighted target-model draws, so
        // it is read whether or not flow control is on.
        let flow_settings = self.shared.flow.as_ref().map(|f| f.settings());
        let fairness = flow_settings
            .as_deref()
            .map_or(crate::admission::flow::FAIRNESS_HEADER, |s| {
                s.fairness_header.as_str()
            });
        let value = |hv: &HeaderValue| header_str(hv).map(str::to_owned);
        let session = self.shared.affinity.header();
        let session = session.as_deref().map(String::as_str);
        for hv in &map.headers {
            if Some(hv.key.as_str()) == session {
                self.session = self.shared.affinity.session(header_bytes(hv));
                continue;
            }
            if self.slo.read(&hv.key, header_str(hv))? {
                continue;
            }
            if hv.key == ":path" {
                self.path = value(hv);
            } else if let Some(i) = OBJECTIVE_HEADERS.iter().position(|k| *k == hv.key) {
                // The current header wins over the former one.
                if i == 0 || self.objective.is_none() {
                    self.objective = value(hv);
                }
            } else if hv.key == fairness {
                self.flow = value(hv);
            }
        }
        Ok(())
    }

    fn on_request_headers(&mut self, h: HttpHeaders, out: &mut Vec<ProcessingResponse>) {
        if !matches!(self.phase, Phase::Start) {
            return;
        }
        let slo = self.read_headers(&h);
        if let Some(info) = &self.shared.trace {
            let mut t = RequestTrace::start(info, h.headers.as_ref());
            if !h.end_of_stream && self.request_mode != Mode::None {
                t.body_started();
            }
            self.trace = Some(t);
        }
        if let Err(msg) = slo {
            return self.reject(Rejection::new(400, "invalid_slo_header", msg), out);
        }
        if let Mode::Unsupported(m) = self.request_mode {
            let msg = format!("ext_proc request_body_mode {m} is not supported; use BUFFERED or FULL_DUPLEX_STREAMED");
            return self.reject(Rejection::new(500, "unsupported_mode", msg), out);
        }
        if h.end_of_stream || self.request_mode == Mode::None {
            return self.conclude(Vec::new(), BodyShape::Headers, out);
        }
        match self.request_mode {
            Mode::Duplex => self.phase = Phase::DuplexBody(Chunks::default()),
            _ => {
                out.push(resp::request_headers(None, None));
                self.phase = Phase::BufferedBody;
            }
        }
    }

    fn on_request_body(&mut self, b: HttpBody, out: &mut Vec<ProcessingResponse>) {
        let max = self.shared.settings().max_body_bytes;
        match &mut self.phase {
            Phase::BufferedBody => {
                if !b.end_of_stream {
                    let msg = "request body exceeds the proxy's buffer (BUFFERED_PARTIAL sent a partial body)";
                    return self.reject(Rejection::new(413, "body_too_large", msg), out);
                }
                if b.body.len() > max {
                    return self.reject(self.too_large(b.body.len()), out);
                }
                self.conclude(vec![b.body], BodyShape::Buffered, out);
            }
            Phase::DuplexBody(body) => {
                body.len += b.body.len();
                if body.len > max {
                    let len = body.len;
                    return self.reject(self.too_large(len), out);
                }
                if !b.body.is_empty() {
                    body.chunks.push(b.body);
                }
                if b.end_of_stream {
                    self.finish_duplex(false, out);
                }
            }
            // Unexpected here (e.g. a proxy that sends a body after a header-time pick): let it pass.
            Phase::Routed(_) => out.push(resp::request_body_continue()),
            Phase::Start | Phase::Rejected | Phase::Queued(_) => {}
        }
    }

    /// True until the request is routed or answered: a stream that breaks now must not end
    /// quietly, or the proxy would carry on without a decision.
    pub(super) fn undecided(&self) -> bool {
        matches!(
            self.phase,
            Phase::Start | Phase::BufferedBody | Phase::DuplexBody(_) | Phase::Queued(_)
        )
    }

    /// The objective no endpoint was predicted to meet when the last decision left the request
    /// waiting (rather than for capacity).
    pub(super) fn unfit(&self) -> Option<Objective> {
        match &self.phase {
            Phase::Queued(h) => h.unfit,
            _ => None,
        }
    }

    /// Counts `held` as waiting for the pool's first ready endpoint (once).
    fn awaits_endpoint(&self, held: &mut Held) {
        if let (None, Some(f)) = (&held.endpoint_wait, self.shared.flow()) {
            held.endpoint_wait = Some(f.awaits_endpoint(&held.prepared.target_label));
        }
    }

    /// Whether the request waits because the pool has no ready endpoint (scale from zero).
    pub(super) fn awaits_an_endpoint(&self) -> bool {
        matches!(&self.phase, Phase::Queued(h) if h.endpoint_wait.is_some())
    }

    /// The priority at which the request waits for capacity, while it does.
    pub(super) fn queued(&self) -> Option<i32> {
        match &self.phase {
            Phase::Queued(h) => Some(h.prepared.priority),
            _ => None,
        }
    }

    /// Flow control, when on.
    pub(super) fn flow_control(&self) -> Option<Arc<crate::admission::FlowControl>> {
        self.shared.flow().cloned()
    }

    /// The request's flow for fair queueing (empty: the default flow).
    pub(super) fn flow_key(&self) -> &str {
        self.flow.as_deref().unwrap_or("")
    }

    /// Decides a queued request again with `admission` (its turn came, or it may not wait),
    /// from the facts it was prepared with.
    pub(super) fn retry(&mut self, admission: Admission, out: &mut Vec<ProcessingResponse>) {
        if let Some(held) = self.leave_queue() {
            self.decide_and_answer(held, admission, out);
        }
    }

    /// The queued request, taken out of the queue (its queue span ends here); None when the
    /// stream is not queued.
    fn leave_queue(&mut self) -> Option<Held> {
        if !matches!(self.phase, Phase::Queued(_)) {
            return None;
        }
        let Phase::Queued(held) = std::mem::replace(&mut self.phase, Phase::Start) else {
            return None;
        };
        if let Some(t) = &mut self.trace {
            t.dequeued();
        }
        Some(held)
    }

    /// Answers a queued request with `r` (it waited too long, or its queue is full).
    pub(super) fn give_up(&mut self, r: Rejection, out: &mut Vec<ProcessingResponse>) {
        if self.leave_queue().is_some() {
            self.reject(r, out);
        }
    }

    /// How a new request is admitted: without flow control, today's shedding; with it, only to
    /// an unsaturated endpoint, or (None) straight into the queue while others already wait: a
    /// new arrival does not overtake them.
    fn admission(&self) -> Option<Admission> {
        match self.shared.flow() {
            None => Some(Admission::Shed),
            Some(f) if f.busy() => None,
            Some(_) => Some(Admission::Unsaturated),
        }
    }

    /// The proxy sent a message over the gRPC message limit (a body over `max_body_bytes` in one
    /// message): answer 413 as for any oversized body.
    pub(super) fn reject_oversized(&mut self, detail: &str, out: &mut Vec<ProcessingResponse>) {
        let max = self.shared.settings().max_body_bytes;
        self.reject(
            Rejection::new(
                413,
                "body_too_large",
                format!("request body exceeds the limit of {max} bytes ({detail})"),
            ),
            out,
        );
    }

    fn too_large(&self, len: usize) -> Rejection {
        let max = self.shared.settings().max_body_bytes;
        Rejection::new(
            413,
            "body_too_large",
            format!("request body of {len}+ bytes exceeds the limit of {max} bytes"),
        )
    }

    /// The streamed body is complete: decide and answer (or wait, with flow control).
    fn finish_duplex(&mut self, trailers: bool, out: &mut Vec<ProcessingResponse>) {
        let chunks = match std::mem::replace(&mut self.phase, Phase::Start) {
            Phase::DuplexBody(body) => body.chunks,
            other => {
                self.phase = other;
                return;
            }
        };
        self.conclude(chunks, BodyShape::Duplex { trailers }, out);
    }

    /// The request is complete (`chunks`, answered as `shape`): prepare its facts once, admit
    /// it, then decide and answer, queue it (flow control) or reject it.
    fn conclude(
        &mut self,
        chunks: Vec<Bytes>,
        shape: BodyShape,
        out: &mut Vec<ProcessingResponse>,
    ) {
        let arrived = Instant::now();
        // One contiguous view of the body: the chunk itself, or a single copy of many chunks
        // (made once, kept while the request waits).
        let joined = (chunks.len() > 1).then(|| Bytes::from(chunks.concat()));
        let body = match shape {
            BodyShape::Headers => None,
            _ => Some(body_view(&chunks, joined.as_ref())),
        };
        if let Some(t) = &mut self.trace {
            t.body_done();
        }
        let stage = self.trace.as_ref().map(|t| t.stage(Stage::Tokenize));
        let head = RequestHead {
            path: self.path.as_deref(),
            objective: self.objective.as_deref(),
            draw_key: self
                .session
                .map(|k| k.0)
                .or_else(|| self.flow.as_deref().map(|f| SessionKey::of(f).0)),
        };
        let prepared = self.shared.routing.prepare(body, &head);
        drop(stage);
        let prepared = match prepared {
            Ok(p) => p,
            Err(r) => return self.reject(r, out),
        };
        if let Err(r) = self.shared.limits.check(
            self.flow.as_deref(),
            self.objective.as_deref(),
            prepared.prompt_tokens,
            arrived,
        ) {
            self.labels =
                Some(self.labels_for(prepared.model_label.clone(), prepared.target_label.clone()));
            tracing::debug!(tenant = self.flow.as_deref(), "tenant over its rate limit");
            return self.reject(r, out);
        }
        if let Some(t) = &self.trace {
            t.prepared(&prepared, self.objective.as_deref());
        }
        let held = Held {
            chunks,
            joined,
            shape,
            prepared,
            arrived,
            unfit: None,
            endpoint_wait: None,
        };
        match self.admission() {
            Some(admission) => self.decide_and_answer(held, admission, out),
            None => self.enqueue(held),
        }
    }

    /// The request waits in flow control's queue (counted as waiting for an endpoint while the
    /// pool has none).
    fn enqueue(&mut self, mut held: Held) {
        if !self.shared.routing.has_endpoints() {
            self.awaits_endpoint(&mut held);
        }
        self.phase = Phase::Queued(held);
        if let Some(t) = &mut self.trace {
            t.queued();
        }
    }

    /// The routing headers for `pick`, with the decision's trace context when traced.
    fn mutation(
        &self,
        dest: &str,
        len: Option<usize>,
        pick: &Pick,
    ) -> envoy_types::pb::envoy::service::ext_proc::v3::HeaderMutation {
        let mut m = resp::routing_mutation(dest, len, pick);
        if let Some(t) = &self.trace {
            t.inject(&mut m.set_headers);
        }
        m
    }

    /// Decides the held request with `admission`: answers it, queues it (flow control: no
    /// unsaturated endpoint now) or rejects it.
    fn decide_and_answer(
        &mut self,
        mut held: Held,
        admission: Admission,
        out: &mut Vec<ProcessingResponse>,
    ) {
        match self.decide(&mut held, admission) {
            Ok(Some((d, routed))) => {
                self.answer(d, held, out);
                self.phase = Phase::Routed(routed);
                // The decision is sent: its span ends.
                self.trace = None;
            }
            Ok(None) if self.shared.flow().is_some() => self.enqueue(held),
            // Without flow control nothing waits: the admission was `Shed`, which never waits.
            Ok(None) => self.reject(
                Rejection::saturated("every eligible endpoint is saturated"),
                out,
            ),
            Err(r) => self.reject(r, out),
        }
    }

    /// Sends the routing answer for the held request.
    fn answer(&self, d: Decision, held: Held, out: &mut Vec<ProcessingResponse>) {
        let dest = resp::destination_value(&d.pick, self.shared.settings().destination_list);
        let Held {
            chunks,
            joined,
            shape,
            ..
        } = held;
        match shape {
            BodyShape::Headers => {
                out.push(resp::request_headers(
                    Some(self.mutation(&dest, None, &d.pick)),
                    Some(resp::lb_metadata(&dest, &d.pick)),
                ));
            }
            BodyShape::Buffered => {
                let body = body_view(&chunks, joined.as_ref());
                let (new_body, len) = match &d.rewrite {
                    Some((span, model)) => {
                        let new = Rewrite::new(body, span.clone(), model).to_vec();
                        let len = new.len();
                        (Some(new), Some(len))
                    }
                    None => (None, None),
                };
                out.push(resp::request_body_buffered(
                    self.mutation(&dest, len, &d.pick),
                    new_body,
                    resp::lb_metadata(&dest, &d.pick),
                ));
            }
            BodyShape::Duplex { trailers } => {
                // The body goes back in the chunks Envoy sent (moved, not copied): a chunk no
                // larger than one Envoy sent fits Envoy's own gRPC message limit. A rewritten body
                // is cut at the same size, and never above 64 KiB unless Envoy sent larger chunks.
                let out_chunks = match &d.rewrite {
                    None => chunks,
                    Some((span, model)) => {
                        let max = chunks
                            .iter()
                            .map(Bytes::len)
                            .max()
                            .unwrap_or(0)
                            .max(resp::MAX_STREAMED_CHUNK);
                        let body = body_view(&chunks, joined.as_ref());
                        let new = Rewrite::new(body, span.clone(), model).chunks(max);
                        new.into_iter().map(Bytes::from).collect()
                    }
                };
                // Envoy keeps the client's framing (Content-Length or chunked) when the body length
                // is unchanged; only a rewritten body needs its new length.
                let len = d
                    .rewrite
                    .is_some()
                    .then(|| out_chunks.iter().map(Bytes::len).sum::<usize>());
                out.push(resp::request_headers(
                    Some(self.mutation(&dest, len, &d.pick)),
                    Some(resp::lb_metadata(&dest, &d.pick)),
                ));
                let n = out_chunks.len();
                if n == 0 {
                    out.push(resp::request_body_chunk(Bytes::new(), !trailers));
                }
                for (i, c) in out_chunks.into_iter().enumerate() {
                    out.push(resp::request_body_chunk(c, i + 1 == n && !trailers));
                }
                if trailers {
                    out.push(resp::trailers_continue(true));
                }
            }
        }
    }

    /// Asks the routing service for a decision on the held request's facts; keeps its labels on
    /// this stream and returns the decision with what the routed phase holds (its booking).
    /// `Ok(None)`: no unsaturated endpoint now (the request may wait).
    fn decide(
        &mut self,
        held: &mut Held,
        admission: Admission,
    ) -> Result<Option<(Decision, Routed)>, Rejection> {
        let started = Instant::now();
        let _stage = self.trace.as_ref().map(|t| t.stage(Stage::Pick));
        let shared = self.shared.clone();
        let prepared = &held.prepared;
        let hints = RouteHints {
            subset: match &self.subset {
                Subset::Unset => None,
                Subset::Only(list) => Some(list.as_slice()),
            },
            admission,
            scores: shared.settings().endpoint_scores,
            session: self.session,
            ttft_budget_ms: self.slo.ttft_budget_ms(
                held.arrived.elapsed().as_secs_f64() * 1000.0,
                shared
                    .flow()
                    .and_then(|f| f.settings().ttft_budget_ms(held.arrived)),
            ),
            tpot_budget_ms: self.slo.tpot_ms,
        };
        let labels = (prepared.model_label.clone(), prepared.target_label.clone());
        let routed = match shared.routing.decide(prepared, &hints) {
            Ok(Verdict::Routed(r)) => r,
            Ok(verdict @ (Verdict::Wait | Verdict::Unfit(_) | Verdict::NoEndpoint)) => {
                held.unfit = match verdict {
                    Verdict::Unfit(o) => Some(o),
                    _ => None,
                };
                if matches!(verdict, Verdict::NoEndpoint) {
                    self.awaits_endpoint(held);
                }
                return Ok(None);
            }
            Err(r) => {
                if let Some((model, target)) = &r.labels {
                    self.labels = Some(self.labels_for(model.clone(), target.clone()));
                }
                return Err(r);
            }
        };
        let rewrite = held.prepared.rewrite.clone();
        let pick = routed.pick;
        if let Some(t) = &self.trace {
            t.routed(&pick);
        }
        tracing::debug!(
            model = &*labels.0,
            target = &*labels.1,
            endpoint = %pick.primary.name,
            addr = %pick.primary.addr_str,
            in_flight = pick.primary.load.in_flight(),
            fallback = pick.fallback.as_ref().map(|f| &*f.name),
            mode = routed.mode.as_str(),
            kv = ?pick.kv,
            session = routed.session.map(|s| s.as_str()),
            adapter = pick.adapter.map(|a| a.as_str()),
            "{}",
            reason(&pick, routed.session)
        );
        shared.affinity.count(routed.session, pick.adapter);
        if let Some(p) = &pick.pairing {
            tracing::debug!(
                prefill = %p.prefill.name,
                prefill_addr = %p.prefill.addr_str,
                decode = %pick.primary.name,
                prefill_domain = p.prefill_domain.as_deref(),
                decode_domain = p.decode_domain.as_deref(),
                crossed = p.crossed,
                transfer_ms = p.transfer_ms,
                "disaggregated pick: prefill worker hands its KV cache to the decode worker"
            );
            shared.metrics.count_pair(p);
        }
        if let Some(kv) = &pick.kv {
            let mode = routed.mode.as_str();
            shared.metrics.count_prefix_mode(mode);
            shared.metrics.repicks.inc_by(u64::from(routed.repicks));
            if kv.load_bounded {
                shared.metrics.load_bounded.inc();
            }
            shared
                .metrics
                .count_prefix_blocks(mode, kv.prompt_blocks, kv.overlap.disk);
        }
        let rewritten = held.prepared.rewritten_by.clone().map(|rewrite| {
            let l = RewriteLabels {
                rewrite,
                target_model: labels.1.clone(),
            };
            shared.metrics.model_rewrites.get_or_create(&l).inc();
            l
        });
        let mut labels = self.labels_for(labels.0, labels.1);
        labels.endpoint = pick.primary.addr_str.clone();
        self.labels = Some(labels);
        let state = Routed {
            booking: Some(routed.booking),
            primary: pick.primary.addr,
            awaiting_first_token: false,
            output: None,
            rewritten,
        };
        shared
            .metrics
            .pick_duration
            .observe(started.elapsed().as_secs_f64());
        Ok(Some((Decision { pick, rewrite }, state)))
    }

    fn labels_for(&self, model: Arc<str>, target_model: Arc<str>) -> RequestLabels {
        RequestLabels {
            model,
            target_model,
            endpoint: self.shared.no_endpoint.clone(),
            code: Outcome::NoResponse,
        }
    }

    fn reject(&mut self, r: Rejection, out: &mut Vec<ProcessingResponse>) {
        tracing::info!(status = r.status, reason = r.reason, message = %r.message, "request answered by the EPP");
        if let Some(t) = self.trace.take() {
            t.rejected(&r);
        }
        self.shared
            .metrics
            .rejected
            .get_or_create(&ReasonLabels { reason: r.reason })
            .inc();
        let labels = self.labels.get_or_insert_with(|| RequestLabels {
            model: self.shared.no_model.clone(),
            target_model: self.shared.no_model.clone(),
            endpoint: self.shared.no_endpoint.clone(),
            code: Outcome::NoResponse,
        });
        labels.code = Outcome::Status(r.status);
        out.push(resp::immediate(
            r.status,
            r.kind,
            &r.message,
            r.retry_after_s,
        ));
        // Whatever the phase held (a body, a booking) goes with it.
        self.phase = Phase::Rejected;
    }

    fn on_response_headers(&mut self, h: &HttpHeaders, served: Option<std::net::SocketAddr>) {
        let status = status_of(h.headers.as_ref());
        if let (Some(labels), Some(code)) = (&mut self.labels, status) {
            labels.code = Outcome::Status(code);
        }
        let Phase::Routed(r) = &mut self.phase else {
            return;
        };
        if let (Some(rw), Some(404)) = (&r.rewritten, status) {
            tracing::warn!(rewrite = %rw.rewrite, target_model = %rw.target_model,
                "the engine answered 404 to a rewritten request: the InferenceModelRewrite's target model is not served there");
            self.shared
                .metrics
                .model_rewrite_unserved
                .get_or_create(rw)
                .inc();
        }
        // An engine starts an event stream's headers as soon as it takes the request (vLLM does):
        // its prefill ends with the first chunk, when the proxy sends us the body. Anything else
        // is answered when it is done.
        r.awaiting_first_token = status == Some(200)
            && self.response_mode != Mode::None
            && h.headers.as_ref().is_some_and(|m| {
                m.headers.iter().any(|v| {
                    v.key.eq_ignore_ascii_case("content-type")
                        && header_str(v).is_some_and(|t| t.starts_with("text/event-stream"))
                })
            });
        r.output = r.awaiting_first_token.then(OutputTokens::default);
        if !r.awaiting_first_token {
            r.first_byte();
        }
        let Some(served) = served else { return };
        if served == r.primary {
            return;
        }
        // The proxy used another endpoint (e.g. the fallback): move the booking and the label there.
        self.shared.metrics.served_elsewhere.inc();
        if let Some(ep) = self.shared.routing.endpoint(served) {
            if let Some(b) = &mut r.booking {
                b.move_to(&ep.load);
            }
            if let Some(l) = &mut self.labels {
                l.endpoint = ep.addr_str.clone();
            }
            r.primary = served;
        }
    }
}

impl Routed {
    /// The response's first byte: the booking's prefill is done.
    fn first_byte(&mut self) {
        if let Some(b) = &mut self.booking {
            b.first_byte();
        }
    }
}

/// Why the pick went where it did, for the decision's log line.
fn reason(pick: &Pick, session: Option<kvepp_core::affinity::SessionOutcome>) -> &'static str {
    use kvepp_core::affinity::SessionOutcome;
    match (session, pick.kv.is_some()) {
        (Some(SessionOutcome::Hit), _) => "picked: the endpoint the request's session is bound to",
        (Some(SessionOutcome::Moved), _) => "picked: the session's bound endpoint could not take it (gone, ineligible or saturated); bound to this pick",
        (_, true) => "picked: lowest KV-aware cost (prefix overlap, prefill and decode load, adapter)",
        (_, false) => "picked by the load-only picker (least in-flight requests, or round robin)",
    }
}

/// A header's value as Envoy sent it: `raw_value` (older proxies `value`).
fn header_bytes(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// A header's value as text (None: not UTF-8).
fn header_str(h: &HeaderValue) -> Option<&str> {
    std::str::from_utf8(header_bytes(h)).ok()
}

fn status_of(headers: Option<&HeaderMap>) -> Option<u16> {
    let h = headers?.headers.iter().find(|h| h.key == ":status")?;
    header_str(h)?.parse().ok()
}

/// The body as one buffer: the single chunk, or the joined copy of several.
fn body_view<'a>(chunks: &'a [Bytes], joined: Option<&'a Bytes>) -> &'a Bytes {
    static EMPTY: Bytes = Bytes::new();
    match (joined, chunks) {
        (Some(j), _) => j,
        (None, [one]) => one,
        (None, _) => &EMPTY,
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        // The booking first: the request is over before it is counted (an abort teaches nothing).
        self.release_at_end(false);
        if let Some(labels) = self.labels.take() {
            self.shared.metrics.requests.get_or_create(&labels).inc();
        }
    }
}

#[cfg(test)]
mod tests;
