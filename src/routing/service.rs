//! The routing service the ext_proc door calls, in two steps: [`RouteRequest::prepare`] (a request
//! body, or none, and its objective in; owned [`Prepared`] facts or a [`Rejection`] out) and
//! [`RouteRequest::decide`] (the facts and the proxy's hints in; a booked decision, a
//! [`Verdict::Wait`] when flow control may queue the request, or a rejection out).
//!
//! It owns the step from bytes to facts: parse in place, resolve the model against the pool's
//! InferenceModels, tokenize when the picker wants the prompt, and hash the prompt into blocks,
//! once per request: a request that waits in flow control keeps its facts and is decided again
//! from them, never parsed, resolved, tokenized or hashed twice. Deciding is the core's
//! [`Router`], which picks and books. It knows nothing of ext_proc messages or HTTP servers: a
//! rejection is a status code, a stable reason and a message, which each front door renders.

use bytes::Bytes;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvepp_core::{
    is_sheddable, Admission, Booking, Endpoint, Pick, PickContext, PickError, PrefixMode, Prompt,
    PromptBlocks, RequestFacts, Router,
};

use super::prompt::{prompt_for_routing, prompt_input};
use super::{resolve_model, ModelError, UNLISTED_MODEL_LABEL};
use crate::discovery::Datastore;
use crate::metrics::PrepareSteps;
use kvepp_request::BodyError;
use kvepp_request::{
    parse_body_as, Format, IdChunks, KnownArrays, RawMessages, ID_CHUNK_CACHE_IDS,
};
use kvepp_tokenizer::ModelTokenizer;

/// Why the EPP answers a request itself instead of routing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// HTTP status of the answer.
    pub status: u16,
    /// OpenAI-style error type (`invalid_request_error`, `rate_limit_error`, ...).
    pub kind: &'static str,
    /// Stable reason (the `reason` label of `kvepp_rejected_total`).
    pub reason: &'static str,
    pub message: String,
    /// Metric labels (model, target model) when the model was known before the rejection.
    pub labels: Option<(Arc<str>, Arc<str>)>,
    /// Seconds the client should wait before retrying (the `retry-after` header), when known.
    pub retry_after_s: Option<u64>,
}

impl Rejection {
    pub(crate) fn new(status: u16, reason: &'static str, message: impl Into<String>) -> Self {
        let kind = match status {
            429 => "rate_limit_error",
            500 => "internal_error",
            503 => "service_unavailable",
            _ => "invalid_request_error",
        };
        Rejection {
            status,
            kind,
            reason,
            message: message.into(),
            labels: None,
            retry_after_s: None,
        }
    }

    /// Every eligible endpoint is saturated for a request that may be shed.
    pub(crate) fn saturated(message: impl Into<String>) -> Self {
        Rejection::new(429, "saturated", message)
    }

    /// No endpoint can meet the request's `objective`: 429 for a sheddable request, 503 for the
    /// others (flow control's rules), the reason naming the objective.
    pub(crate) fn over_objective(
        message: impl Into<String>,
        priority: i32,
        objective: Objective,
    ) -> Self {
        let status = if is_sheddable(priority) { 429 } else { 503 };
        Rejection::new(status, objective.reason(), message)
    }
}

impl From<BodyError> for Rejection {
    fn from(e: BodyError) -> Self {
        let reason = match e {
            BodyError::Malformed(_) | BodyError::NotAnObject => "malformed_body",
            BodyError::MissingModel | BodyError::ModelNotString => "missing_model",
        };
        Rejection::new(400, reason, e.to_string())
    }
}

impl Rejection {
    fn from_pick(e: PickError, priority: i32) -> Self {
        match e {
            PickError::Saturated(_) if is_sheddable(priority) => Rejection::saturated(format!(
                "{e}; sheddable request (priority {priority}) dropped"
            )),
            PickError::Saturated(_) => Rejection::saturated(e.to_string()),
            PickError::OverObjective { .. } => {
                Rejection::over_objective(e.to_string(), priority, Objective::Ttft)
            }
            PickError::OverTpotObjective { .. } => {
                Rejection::over_objective(e.to_string(), priority, Objective::Tpot)
            }
            PickError::NoReadyEndpoints => Rejection::new(503, "no_ready_endpoints", e.to_string()),
            PickError::EmptySubset | PickError::NoEligibleInSubset(_) => {
                Rejection::new(503, "subset_no_match", e.to_string())
            }
            PickError::NoDecodeEndpoints => {
                Rejection::new(503, "no_decode_endpoints", e.to_string())
            }
            PickError::TopologyMismatch { .. } => {
                Rejection::new(503, "topology_mismatch", e.to_string())
            }
            // Process-local booking ids never collide: a bug, answered rather than routed twice.
            PickError::DuplicateBooking(_) => {
                Rejection::new(500, "duplicate_booking", e.to_string())
            }
        }
    }
}

/// A latency objective a request can be refused or held for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// Time to first token (flow control's `ttft_objective_ms`, the `x-slo-ttft-ms` header).
    Ttft,
    /// Time per output token (the `x-slo-tpot-ms` header).
    Tpot,
}

impl Objective {
    /// The rejection reason (the `reason` label of the rejections counter).
    pub fn reason(self) -> &'static str {
        match self {
            Objective::Ttft => "ttft_objective",
            Objective::Tpot => "tpot_objective",
        }
    }
}

/// What a request's headers said that preparing it reads.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestHead<'a> {
    /// The request's `:path` (None: the proxy sent none; the body is read as OpenAI's).
    pub path: Option<&'a str>,
    /// The InferenceObjective its header names.
    pub objective: Option<&'a str>,
    /// The key weighted target models are drawn by (the session header's key, else the
    /// fairness id's): None draws at random.
    pub draw_key: Option<u64>,
}

/// What the proxy said about a request besides its body, and how it is admitted.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteHints<'a> {
    /// The proxy's subset hint: when `Some`, only these endpoints may be picked.
    pub subset: Option<&'a [SocketAddr]>,
    /// [`Admission::Shed`]: shed sheddable requests (429) when every eligible endpoint is
    /// saturated, route the others anyway (no flow control). [`Admission::Unsaturated`]: only to
    /// an endpoint that is not saturated, else [`Verdict::Wait`] (flow control queues it).
    pub admission: Admission,
    /// Report every candidate's score with the pick.
    pub scores: bool,
    /// The request's session (its session header), when it has a usable one.
    pub session: Option<kvepp_core::affinity::SessionKey>,
    /// What is left of the request's TTFT objective, in ms (the tighter of flow control's
    /// `ttft_objective_ms` and the request's `x-slo-ttft-ms`, less the time since it arrived);
    /// None: no objective.
    pub ttft_budget_ms: Option<f64>,
    /// The request's time-per-output-token objective, in ms (`x-slo-tpot-ms`); None: none.
    pub tpot_budget_ms: Option<f64>,
}

/// A request as the routing core needs it, built once ([`RouteRequest::prepare`]) and owned: flow
/// control keeps it while the request waits, and every turn decides from it.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// InferenceObjective priority (higher is more important; negative is sheddable).
    pub priority: i32,
    /// The model the engine serves (after any rewrite); None for a request without a body.
    pub served: Option<Arc<str>>,
    /// The prompt as KV blocks, hashed once (None: no prompt, or a load-only picker).
    pub prompt: Option<PromptBlocks>,
    /// Where the `model` value is in the body and what it becomes, when it must be rewritten.
    pub rewrite: Option<(Range<usize>, Arc<str>)>,
    /// Metric labels: the InferenceModel (or `none`/`unlisted`) and the target model.
    pub model_label: Arc<str>,
    pub target_label: Arc<str>,
    /// The InferenceModelRewrite that chose the target model, when one did (traces).
    pub rewritten_by: Option<Arc<str>>,
    /// The prompt's length in tokens (estimated from its bytes when not tokenized): what tenant
    /// rate limits charge.
    pub prompt_tokens: u64,
    /// The request's cap on output tokens (`max_completion_tokens`, `max_tokens`,
    /// `max_output_tokens`), when it gives one: the decode cost's output length at most.
    pub max_tokens: Option<u64>,
}

impl Prepared {
    /// Metric labels to carry on a rejection.
    fn labels(&self) -> (Arc<str>, Arc<str>) {
        (self.model_label.clone(), self.target_label.clone())
    }
}

/// A routed request: the core's pick and booking.
#[derive(Debug)]
pub struct Routed {
    pub pick: Pick,
    pub mode: PrefixMode,
    /// Released when dropped (end of the response, abort, or the stream going away).
    pub booking: Booking,
    /// Picks made again because the chosen endpoint's load changed before its booking.
    pub repicks: u32,
    /// What the pick did to the request's session binding (None: no session).
    pub session: Option<kvepp_core::affinity::SessionOutcome>,
}

/// What a decision came to.
// Returned once per decision and moved straight into the stream: boxing the routed variant would
// allocate per request for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Verdict {
    Routed(Routed),
    /// Every eligible endpoint is saturated and the request was admitted only to an unsaturated
    /// one ([`Admission::Unsaturated`]): it may wait for capacity.
    Wait,
    /// No endpoint is predicted to meet the request's objective (the first token within what is
    /// left of its TTFT objective, or its time per output token), though an idle one would: it
    /// may wait, behind the others (it holds no one up).
    Unfit(Objective),
    /// The pool has no ready endpoint and the request was admitted only to an unsaturated one
    /// (flow control): it may wait for the first endpoint to become ready (scale from zero).
    NoEndpoint,
}

/// What the ext_proc door calls to route one request: prepare once, decide as often as its turns
/// come.
pub trait RouteRequest: Send + Sync + std::fmt::Debug {
    /// The request's facts from its `body` (None: decided at the headers, no model) and what
    /// its headers said.
    fn prepare(&self, body: Option<&Bytes>, head: &RequestHead<'_>) -> Result<Prepared, Rejection>;

    /// Decides `req` among the pool's ready endpoints, restricted to the hints' subset when the
    /// proxy sent one.
    fn decide(&self, req: &Prepared, hints: &RouteHints<'_>) -> Result<Verdict, Rejection>;

    /// Whether some ready endpoint is below its saturation limits (flow control dispatches a
    /// queued request only then).
    fn has_capacity(&self) -> bool;

    /// Whether the pool has a ready endpoint at all (false: requests wait for one to start).
    fn has_endpoints(&self) -> bool {
        true
    }

    /// The ready endpoint at `addr` (the proxy reported it served the request).
    fn endpoint(&self, addr: SocketAddr) -> Option<Arc<Endpoint>>;
}

/// [`RouteRequest`] over the pool's datastore and the core's [`Router`].
#[derive(Debug)]
pub struct RequestRouter {
    store: Arc<Datastore>,
    router: Arc<Router>,
    /// Tokenizers by served model name (the KV-aware picker's `tokens` mode); replaced whole on
    /// a reload.
    tokenizers: arc_swap::ArcSwap<Tokenizers>,
    /// Route models with no InferenceModel as Standard instead of rejecting them (404); changed
    /// on a reload.
    pass_through_unknown: std::sync::atomic::AtomicBool,
    /// Metric labels, allocated once: requests without a body, and models with no InferenceModel.
    no_model: Arc<str>,
    unlisted_model: Arc<str>,
    /// What preparing requests took: bodies parsed, prompts tokenized, prompts hashed.
    steps: PrepareSteps,
    /// Chunks of token-id prompts already read, by their text.
    id_chunks: IdChunks,
    /// Recent chat requests' `messages` arrays, split.
    known_arrays: KnownArrays,
    /// Requests for paths kvepp does not know, by path (the first [`MAX_PATH_LABELS`] paths by
    /// name, the rest as `other`).
    unknown_paths: Family<crate::metrics::PathLabels, Counter>,
    labelled_paths: crate::metrics::BoundedLabels,
}

/// Paths named in `kvepp_unknown_path_requests_total`; the others are counted as `other`.
pub const MAX_PATH_LABELS: usize = 32;

impl RequestRouter {
    pub fn new(store: Arc<Datastore>, router: Arc<Router>, pass_through_unknown: bool) -> Self {
        RequestRouter {
            store,
            router,
            tokenizers: Default::default(),
            pass_through_unknown: pass_through_unknown.into(),
            no_model: "none".into(),
            unlisted_model: UNLISTED_MODEL_LABEL.into(),
            steps: PrepareSteps::default(),
            id_chunks: IdChunks::new(ID_CHUNK_CACHE_IDS),
            known_arrays: KnownArrays::default(),
            unknown_paths: Family::default(),
            labelled_paths: crate::metrics::BoundedLabels::new(MAX_PATH_LABELS),
        }
    }

    /// Counts requests for unknown paths into `family` (`kvepp_unknown_path_requests_total`).
    pub(crate) fn with_unknown_paths(
        mut self,
        family: Family<crate::metrics::PathLabels, Counter>,
    ) -> Self {
        self.unknown_paths = family;
        self
    }

    fn count_unknown_path(&self, path: &str) {
        let path = path.split(['?', '#']).next().unwrap_or_default();
        let label = self.labelled_paths.label(path);
        tracing::debug!(
            path,
            "path kvepp does not know: routed by load, body untouched"
        );
        self.unknown_paths
            .get_or_create(&crate::metrics::PathLabels { path: label })
            .inc();
    }

    /// Counts token ids of prompts by where they came from into `ids`
    /// (`kvepp_prompt_token_ids_total{source}`).
    pub(crate) fn with_id_counts(
        mut self,
        ids: &prometheus_client::metrics::family::Family<
            crate::metrics::HashSourceLabels,
            prometheus_client::metrics::counter::Counter,
        >,
    ) -> Self {
        let count = |source| {
            ids.get_or_create(&crate::metrics::HashSourceLabels { source })
                .clone()
        };
        self.id_chunks = self.id_chunks.counting_into(count("cached"), count("read"));
        self
    }

    /// Counts the preparation steps into `steps` (`kvepp_request_preparation_steps_total`).
    pub(crate) fn with_steps(mut self, steps: PrepareSteps) -> Self {
        self.steps = steps;
        self
    }

    /// Tokenizes prompts for `model` (served name) with `tokenizer`.
    pub(crate) fn with_tokenizer(self, model: String, tokenizer: Arc<ModelTokenizer>) -> Self {
        let mut all = Tokenizers::clone(&self.tokenizers.load());
        all.insert(model, tokenizer);
        self.set_tokenizers(all);
        self
    }

    /// Live reconfiguration: requests prepared afterwards use these tokenizers.
    pub(crate) fn set_tokenizers(&self, tokenizers: Tokenizers) {
        self.tokenizers.store(Arc::new(tokenizers));
    }

    /// The tokenizers requests use now.
    pub(crate) fn tokenizers(&self) -> Arc<Tokenizers> {
        self.tokenizers.load_full()
    }

    /// Live reconfiguration: whether models with no InferenceModel are routed (true) or 404.
    pub(crate) fn set_pass_through_unknown(&self, on: bool) {
        self.pass_through_unknown
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn passes_unknown(&self) -> bool {
        self.pass_through_unknown
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Tokenizers by served model name.
pub type Tokenizers = std::collections::HashMap<String, Arc<ModelTokenizer>>;

impl RequestRouter {
    /// The priority of a request naming `objective` (None: `fallback`, from its InferenceModel);
    /// an objective the pool does not have is rejected like an unknown model.
    fn priority(
        &self,
        objectives: &std::collections::HashMap<String, i32>,
        objective: Option<&str>,
        fallback: i32,
    ) -> Result<i32, Rejection> {
        let Some(name) = objective else {
            return Ok(fallback);
        };
        match objectives.get(name) {
            Some(p) => Ok(*p),
            None if self.passes_unknown() => Ok(0),
            None => {
                let t = self.store.target();
                let mut r = Rejection::new(
                    404,
                    "unknown_objective",
                    format!(
                        "InferenceObjective {name:?} is not defined for InferencePool {}/{}",
                        t.namespace, t.name
                    ),
                );
                r.labels = Some((self.unlisted_model.clone(), self.unlisted_model.clone()));
                Err(r)
            }
        }
    }

    fn pool_not_found(&self) -> Rejection {
        let t = self.store.target();
        Rejection::new(
            503,
            "pool_not_found",
            format!("InferencePool {}/{} is not known yet", t.namespace, t.name),
        )
    }

    fn context(&self, hints: &RouteHints<'_>) -> PickContext {
        let ctx = PickContext::new(fastrand::Rng::new(), Instant::now());
        if hints.scores {
            ctx.with_scores()
        } else {
            ctx
        }
    }
}

impl RouteRequest for RequestRouter {
    fn prepare(&self, body: Option<&Bytes>, head: &RequestHead<'_>) -> Result<Prepared, Rejection> {
        let objective = head.objective;
        let snap = self.store.snapshot();
        if snap.pool.is_none() {
            return Err(self.pool_not_found());
        }
        // The format the path names; a path kvepp does not know is routed by load, its body
        // untouched (no path: an OpenAI body, as a proxy that sends none means).
        let format = match head.path {
            None => Some(Format::OpenAi),
            Some(p) => Format::of_path(p),
        };
        if format.is_none() {
            self.count_unknown_path(head.path.unwrap_or_default());
        }
        let (Some(body), Some(format)) = (body, format) else {
            let priority = self.priority(&snap.objectives, objective, 0)?;
            return Ok(Prepared {
                priority,
                served: None,
                prompt: None,
                rewrite: None,
                model_label: self.no_model.clone(),
                target_label: self.no_model.clone(),
                rewritten_by: None,
                prompt_tokens: 0,
                max_tokens: None,
            });
        };
        self.steps.count("parse");
        let mut parsed = parse_body_as(body, format, Some(&self.id_chunks), &self.known_arrays)?;
        let unlisted = self.passes_unknown().then_some(&self.unlisted_model);
        let m = match resolve_model(&snap, &parsed.model, unlisted, head.draw_key) {
            Ok(m) => m,
            Err(e @ ModelError::Unknown(_)) => {
                let mut r = Rejection::new(404, "unknown_model", e.to_string());
                r.labels = Some((self.unlisted_model.clone(), self.unlisted_model.clone()));
                return Err(r);
            }
        };
        let priority = self
            .priority(&snap.objectives, objective, m.criticality.priority())
            .map_err(|mut r| {
                r.labels = Some((m.model_label.clone(), m.target_label.clone()));
                r
            })?;
        let served: Arc<str> = match &m.rewrite_to {
            Some(t) => t.clone(),
            None => parsed.model.as_ref().into(),
        };
        let max_tokens = parsed.max_output_tokens;
        let prompt = if self.router.wants_prompt() {
            let tokenizers = self.tokenizers.load();
            let tokenizer = tokenizers.get(&*served).map(|t| &**t);
            // Responses and Anthropic Messages: their conversation as chat messages.
            let chat = super::formats::chat_messages(
                format,
                parsed.system,
                parsed.messages.as_ref(),
                parsed.prompt.as_ref(),
            )
            .and_then(|m| serde_json::value::RawValue::from_string(m).ok());
            let input = match &chat {
                Some(raw) => prompt_input(Some(RawMessages::of(raw)), None),
                None => prompt_input(parsed.messages, parsed.prompt.take()),
            };
            if tokenizer.is_some() && input.raw_bytes().is_some() {
                self.steps.count("tokenize");
            }
            let p = prompt_for_routing(tokenizer, input, &served, &m.target_label);
            let blocks = self.router.blocks(Some(&served), p);
            if blocks.is_some() {
                self.steps.count("hash");
            }
            blocks
        } else {
            None
        };
        // Without a tokenized prompt, ~4 bytes a token (the body, less its framing, is an upper
        // bound of the prompt).
        let prompt_tokens = prompt
            .as_ref()
            .map_or(body.len() as u64 / 4, |p| p.isl_tokens);
        Ok(Prepared {
            priority,
            served: Some(served),
            prompt,
            rewrite: m.rewrite_to.clone().map(|t| (parsed.model_span.clone(), t)),
            model_label: m.model_label.clone(),
            target_label: m.target_label.clone(),
            rewritten_by: m.rewrite.clone(),
            prompt_tokens,
            max_tokens,
        })
    }

    fn decide(&self, req: &Prepared, hints: &RouteHints<'_>) -> Result<Verdict, Rejection> {
        let snap = self.store.snapshot();
        if snap.pool.is_none() {
            return Err(self.pool_not_found());
        }
        let mut ctx = self.context(hints);
        let facts = RequestFacts {
            model: req.served.as_deref(),
            priority: req.priority,
            admission: hints.admission,
            subset: hints.subset,
            prompt: req.prompt.as_ref().map_or(Prompt::None, Prompt::Blocks),
            session: hints.session,
            ttft_budget_ms: hints.ttft_budget_ms,
            tpot_budget_ms: hints.tpot_budget_ms,
            max_tokens: req.max_tokens,
            list: Some(snap.serial),
            ..RequestFacts::default()
        };
        match self.router.route(facts, &snap.endpoints, &mut ctx) {
            Ok(d) => Ok(Verdict::Routed(Routed {
                pick: d.pick,
                mode: d.mode,
                booking: d.booking,
                repicks: d.repicks,
                session: d.session,
            })),
            Err(PickError::Saturated(_)) if hints.admission == Admission::Unsaturated => {
                Ok(Verdict::Wait)
            }
            Err(PickError::NoReadyEndpoints) if hints.admission == Admission::Unsaturated => {
                Ok(Verdict::NoEndpoint)
            }
            // Waiting helps only while an idle endpoint would still meet the budget.
            Err(PickError::OverObjective {
                budget_ms,
                floor_ms,
                ..
            }) if hints.admission == Admission::Unsaturated && floor_ms <= budget_ms => {
                Ok(Verdict::Unfit(Objective::Ttft))
            }
            Err(PickError::OverTpotObjective {
                budget_us,
                floor_us,
                ..
            }) if hints.admission == Admission::Unsaturated && floor_us <= budget_us => {
                Ok(Verdict::Unfit(Objective::Tpot))
            }
            Err(e) => {
                let mut r = Rejection::from_pick(e, req.priority);
                r.labels = Some(req.labels());
                Err(r)
            }
        }
    }

    fn has_capacity(&self) -> bool {
        let snap = self.store.snapshot();
        self.router.has_capacity(&snap.endpoints, Instant::now())
    }

    fn has_endpoints(&self) -> bool {
        !self.store.snapshot().endpoints.is_empty()
    }

    fn endpoint(&self, addr: SocketAddr) -> Option<Arc<Endpoint>> {
        self.store
            .snapshot()
            .endpoints
            .iter()
            .find(|e| e.addr == addr)
            .cloned()
    }
}
