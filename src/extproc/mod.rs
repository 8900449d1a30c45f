//! The Envoy ext_proc protocol: one gRPC stream per HTTP request. Protocol only: the decision
//! comes from the routing service ([`crate::routing::RouteRequest`]).
//!
//! Each stream is driven by a [`stream::StreamState`], a sans-IO state machine (a message in,
//! responses out) that owns the request's body chunks, its booking on the picked endpoint and its
//! metric labels. It runs inside the stream's response body: a message is read and handled when
//! the body is asked for its next answers, so there is no task or channel per stream, and a proxy
//! that reads slowly stops the reading of its messages instead of growing a queue.

mod grpc;
pub(crate) mod metadata;
mod output;
pub(crate) mod response;
mod slo;
mod stream;
pub(crate) mod trace;
/// The ext_proc messages, from the protocol crate.
pub use kvepp_extproc_wire::wire;

pub use grpc::{ExtProcServer, SERVICE};

pub use trace::TraceInfo;

use std::sync::Arc;

use tonic::{Request, Response, Status, Streaming};
use wire::{ProcessingRequest, ProcessingResponse};

use crate::admission::{FlowControl, FlowControlSettings, Turn};
use crate::metrics::Metrics;
use crate::routing::{Objective, Rejection, RouteRequest};
use kvepp_core::Admission;

/// Protocol choices that come from the configuration.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Send `primary,fallback` in the destination header and metadata.
    pub destination_list: bool,
    /// Largest body accepted (413 above it).
    pub max_body_bytes: usize,
    /// How long a stream waits for the pool to be loaded before it is answered (503).
    pub ready_wait: std::time::Duration,
    /// Send every candidate's score with the pick (`x-gateway-destination-endpoint-scores`).
    pub endpoint_scores: bool,
}

/// What every stream shares.
#[derive(Debug)]
pub struct Shared {
    /// The routing service: body → facts → the core's decision and booking.
    pub routing: Arc<dyn RouteRequest>,
    pub metrics: Arc<Metrics>,
    /// Replaced whole on a reload ([`Shared::set_settings`]); `max_body_bytes` and `ready_wait`
    /// are fixed at start (the gRPC limits are sized from them).
    settings: arc_swap::ArcSwap<Settings>,
    /// Readiness of the pool (loaded and synced); streams wait on it up to `ready_wait`.
    pub ready: Option<tokio::sync::watch::Receiver<bool>>,
    /// Flow control: requests wait for capacity instead of being shed (None: off).
    pub flow: Option<Arc<FlowControl>>,
    /// The session header and the affinity counters.
    pub affinity: Arc<crate::routing::Affinity>,
    /// Tenant rate limits, checked before a request is routed or queued.
    pub limits: Arc<crate::admission::RateLimiter>,
    /// Traces on: each decision gets a span ([`trace`]).
    pub trace: Option<Arc<TraceInfo>>,
    /// Metric labels, allocated once: requests answered before a model was known, and before a
    /// pick.
    no_model: Arc<str>,
    no_endpoint: Arc<str>,
}

impl Shared {
    /// Streams wait (up to `settings.ready_wait`) until `ready` is true.
    pub(crate) fn with_readiness(mut self, ready: tokio::sync::watch::Receiver<bool>) -> Self {
        self.ready = Some(ready);
        self
    }

    /// Requests that find the pool saturated wait in `flow` while it is enabled (its
    /// dispatcher runs elsewhere).
    pub(crate) fn with_flow_control(mut self, flow: Arc<FlowControl>) -> Self {
        self.flow = Some(flow);
        self
    }

    /// Each decision gets a trace span, told `info`.
    pub(crate) fn with_tracing(mut self, info: Arc<TraceInfo>) -> Self {
        self.trace = Some(info);
        self
    }

    /// Flow control, when present and enabled now.
    pub(crate) fn flow(&self) -> Option<&Arc<FlowControl>> {
        self.flow.as_ref().filter(|f| f.enabled())
    }

    /// The protocol settings streams use now.
    pub(crate) fn settings(&self) -> arc_swap::Guard<Arc<Settings>> {
        self.settings.load()
    }

    /// Live reconfiguration: streams that start afterwards use `settings`.
    pub(crate) fn set_settings(&self, settings: Settings) {
        self.settings.store(Arc::new(settings));
    }

    /// Requests are checked against `limits` before they are routed.
    pub(crate) fn with_rate_limits(mut self, limits: Arc<crate::admission::RateLimiter>) -> Self {
        self.limits = limits;
        self
    }

    /// Sessions are read from `affinity`'s header, and its counters count the picks.
    pub(crate) fn with_affinity(mut self, affinity: Arc<crate::routing::Affinity>) -> Self {
        self.affinity = affinity;
        self
    }

    pub fn new(routing: Arc<dyn RouteRequest>, metrics: Arc<Metrics>, settings: Settings) -> Self {
        Shared {
            routing,
            metrics,
            settings: arc_swap::ArcSwap::from_pointee(settings),
            ready: None,
            flow: None,
            affinity: Arc::default(),
            limits: Arc::new(crate::admission::RateLimiter::new(
                Default::default(),
                Default::default(),
            )),
            trace: None,
            no_model: "none".into(),
            no_endpoint: "".into(),
        }
    }
}

/// The ext_proc gRPC service.
#[derive(Debug, Clone)]
pub struct ExtProcService {
    shared: Arc<Shared>,
}

/// Room above `max_body_bytes` in one gRPC message: the ext_proc envelope around a body (headers,
/// attributes, metadata) is never near this, so a body at the limit still fits in one message.
const MESSAGE_HEADROOM: usize = 64 << 10;

impl ExtProcService {
    pub(crate) fn new(shared: Arc<Shared>) -> Self {
        ExtProcService { shared }
    }

    /// The tonic server with message limits that fit the largest accepted body.
    pub(crate) fn into_server(self) -> ExtProcServer {
        let limit = self.shared.settings().max_body_bytes + MESSAGE_HEADROOM;
        ExtProcServer::new(self, limit)
    }

    /// One ext_proc stream: its answers, produced as the response body asks for them.
    fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Response<ProcessStream> {
        let settings = self.shared.settings();
        let answers = Answers {
            inbound: request.into_inner(),
            state: stream::StreamState::new(self.shared.clone()),
            ready: self.shared.ready.clone().map(|r| (r, settings.ready_wait)),
            out: Vec::with_capacity(4),
            sent: 0,
            then: Next::Start,
        };
        Response::new(Box::pin(futures::stream::unfold(
            answers,
            |mut a| async move { a.next().await.map(|r| (r, a)) },
        )))
    }
}

/// The answers of one ext_proc stream, in order.
pub type ProcessStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

/// One stream's messages turned into its answers, inside the response body's own polling: no
/// task or channel per stream, and a message is read only when the answers before it have been
/// taken (the proxy's flow control on the response is the backpressure). Dropping it (the proxy
/// reset the stream) drops the state, which releases the request's booking at once.
struct Answers {
    inbound: Streaming<ProcessingRequest>,
    state: stream::StreamState,
    /// Readiness to wait for (bounded) before the first message: right after a start the pool
    /// may not be loaded yet; after the bound the routing service answers 503.
    ready: Option<(tokio::sync::watch::Receiver<bool>, std::time::Duration)>,
    /// Answers of the last step; `out[..sent]` are handed on already.
    out: Vec<ProcessingResponse>,
    sent: usize,
    then: Next,
}

/// What [`Answers`] does once its answers are handed on.
enum Next {
    Start,
    Read,
    /// A request waits in flow control's queue.
    Wait,
    /// End the stream with this status.
    Fail(Status),
    End,
}

impl Answers {
    async fn next(&mut self) -> Option<Result<ProcessingResponse, Status>> {
        loop {
            if let Some(r) = self.out.get_mut(self.sent) {
                self.sent += 1;
                return Some(Ok(std::mem::take(r)));
            }
            self.out.clear();
            self.sent = 0;
            match std::mem::replace(&mut self.then, Next::End) {
                Next::Start => {
                    if let Some((mut ready, wait)) = self.ready.take() {
                        if !*ready.borrow() {
                            let _ = tokio::time::timeout(wait, ready.wait_for(|r| *r)).await;
                        }
                    }
                    self.then = Next::Read;
                }
                Next::Read => self.then = self.read().await,
                Next::Wait => {
                    let (state, inbound) = (&mut self.state, &mut self.inbound);
                    if wait_for_capacity(state, inbound, &mut self.out).await {
                        self.then = Next::Read;
                    } else {
                        // The proxy went away while the request waited.
                        self.out.clear();
                    }
                }
                Next::Fail(status) => return Some(Err(status)),
                Next::End => return None,
            }
        }
    }

    /// Reads and handles the next message, its answers into `out`.
    async fn read(&mut self) -> Next {
        match self.inbound.message().await {
            Ok(Some(msg)) => {
                let observe_only = msg.observability_mode;
                self.state.handle(msg, &mut self.out);
                if observe_only {
                    self.out.clear();
                }
                if self.state.queued().is_some() {
                    Next::Wait
                } else {
                    Next::Read
                }
            }
            Ok(None) => Next::End,
            // Envoy ends every stream with a reset: a normal end once the request was decided.
            // Before that, the stream must not end quietly.
            Err(status) if !self.state.undecided() => {
                tracing::trace!(%status, "ext_proc stream closed by the proxy");
                Next::End
            }
            // A message over the gRPC limit: a body over max_body_bytes in one message.
            Err(status) if status.code() == tonic::Code::OutOfRange => {
                self.state.reject_oversized(status.message(), &mut self.out);
                Next::End
            }
            Err(status) => {
                tracing::warn!(%status, "ext_proc stream failed before a routing decision");
                Next::Fail(Status::aborted(format!(
                    "ext_proc stream failed before a routing decision: {}",
                    status.message()
                )))
            }
        }
    }
}

/// The stream state machine without gRPC: the answers to `messages`, handled in order as one
/// ext_proc stream (no readiness wait, no observability mode). The stream's booking is released
/// when it returns, as when a stream ends. Fuzz targets and tests drive the protocol with it.
pub fn drive(
    shared: Arc<Shared>,
    messages: impl IntoIterator<Item = ProcessingRequest>,
) -> Vec<ProcessingResponse> {
    let mut state = stream::StreamState::new(shared);
    let mut out = Vec::new();
    for msg in messages {
        state.handle(msg, &mut out);
    }
    out
}

/// The answer to a request whose wait in flow control's queue ran out: past its TTFT objective,
/// or still without an endpoint predicted to meet its objective (`unfit`; 429 if sheddable, else
/// 503), or past `max_wait_ms` (503).
fn timed_out(
    s: &FlowControlSettings,
    waited: std::time::Duration,
    priority: i32,
    unfit: Option<Objective>,
) -> Rejection {
    let waited = waited.as_millis();
    if unfit == Some(Objective::Tpot) {
        let msg = format!(
            "no endpoint was predicted to decode within the request's time-per-output-token objective (x-slo-tpot-ms) after {waited} ms waiting; request not routed"
        );
        return Rejection::over_objective(msg, priority, Objective::Tpot);
    }
    if s.ttft_objective_ms > 0 && s.ttft_objective_ms <= s.max_wait_ms {
        let msg = format!(
            "no endpoint could give the first token within the TTFT objective of {} ms (flow_control.ttft_objective_ms) after {waited} ms waiting; request not routed",
            s.ttft_objective_ms
        );
        return Rejection::over_objective(msg, priority, Objective::Ttft);
    }
    if unfit == Some(Objective::Ttft) {
        let msg = format!(
            "no endpoint was predicted to give the first token within the request's TTFT objective (x-slo-ttft-ms) after {waited} ms waiting; request not routed"
        );
        return Rejection::over_objective(msg, priority, Objective::Ttft);
    }
    let msg = format!(
        "no endpoint had capacity within {waited} ms (flow_control.max_wait_ms {}); request not routed",
        s.max_wait_ms
    );
    Rejection::new(503, "queue_timeout", msg)
}

/// The answer to a request that waited `max_wait_ms` for the pool's first ready endpoint.
fn no_endpoint_in_time(s: &FlowControlSettings, waited: std::time::Duration) -> Rejection {
    let msg = format!(
        "no endpoint of the pool became ready within {} ms (flow_control.max_wait_ms {}); request not routed",
        waited.as_millis(),
        s.max_wait_ms
    );
    Rejection::new(503, "no_ready_endpoints", msg)
}

/// Holds a queued request until flow control gives it a turn, its wait runs out or its queue is
/// full, answering it in `out`. Messages the proxy sends meanwhile are handled afterwards. False
/// when the stream ended while waiting (the client left: its place is given up at once).
async fn wait_for_capacity(
    state: &mut stream::StreamState,
    inbound: &mut Streaming<ProcessingRequest>,
    out: &mut Vec<ProcessingResponse>,
) -> bool {
    let (Some(flow), Some(priority)) = (state.flow_control(), state.queued()) else {
        return true;
    };
    let mut ticket = match flow.enqueue(priority, state.flow_key()) {
        Ok(t) => t,
        Err(full) if kvepp_core::is_sheddable(priority) => {
            state.give_up(
                Rejection::new(
                    429,
                    "queue_full",
                    format!("{full}; sheddable request dropped"),
                ),
                out,
            );
            return true;
        }
        // Only sheddable requests are shed: the others go to the best endpoint, saturated or not.
        Err(_) => {
            state.retry(Admission::Shed, out);
            return true;
        }
    };
    let mut later = Vec::new();
    loop {
        tokio::select! {
            turn = ticket.turn() => match turn {
                Turn::Granted(grant) => {
                    state.retry(Admission::Unsaturated, out);
                    let placed = state.queued().is_none();
                    if placed {
                        grant.done(true);
                        ticket.finish("dispatched");
                        break;
                    }
                    if state.unfit().is_some() {
                        // Not the capacity: its own budget. The next waiter may fit now.
                        grant.unfit();
                        ticket.requeue_back();
                    } else {
                        grant.done(false);
                        ticket.requeue();
                    }
                }
                Turn::TimedOut(waited) => {
                    ticket.finish("timeout");
                    let r = if state.awaits_an_endpoint() {
                        no_endpoint_in_time(&flow.settings(), waited)
                    } else {
                        timed_out(&flow.settings(), waited, priority, state.unfit())
                    };
                    state.give_up(r, out);
                    break;
                }
                Turn::Closed => {
                    ticket.finish("dispatched");
                    state.retry(Admission::Shed, out);
                    break;
                }
            },
            msg = inbound.message() => match msg {
                Ok(Some(m)) => later.push(m),
                Ok(None) | Err(_) => return false,
            },
        }
    }
    for m in later {
        state.handle(m, out);
    }
    true
}
