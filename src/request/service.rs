//! The routing service every front door calls: a request body (or none) and the proxy's subset
//! hint in, a booked decision or a [`Rejection`] out.
//!
//! It owns the step from bytes to facts (parse in place, resolve the model against the pool's
//! InferenceModels, tokenize when the picker wants the prompt) and hands the facts to the core's
//! [`Router`], which picks and books. It knows nothing of ext_proc messages or HTTP servers: a
//! rejection is a status code, a stable reason and a message, which each front door renders.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use kvepp_core::{
    is_sheddable, Admission, Booking, Endpoint, Pick, PickContext, PickError, PrefixMode,
    RequestFacts, Router,
};

use super::prompt::{prompt_for_routing, prompt_input};
use super::tokenize::ModelTokenizer;
use super::{parse_body, resolve_model, BodyError, ModelError, UNLISTED_MODEL_LABEL};
use crate::discovery::Datastore;

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
    /// The request's priority, on a saturation refusal (reason `saturated`): flow control may
    /// queue the request at that priority instead of answering.
    pub queue_at: Option<i32>,
}

impl Rejection {
    pub fn new(status: u16, reason: &'static str, message: impl Into<String>) -> Self {
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
            queue_at: None,
        }
    }

    /// Every eligible endpoint is saturated (or others wait already) for a request of `priority`.
    pub fn saturated(priority: i32, message: impl Into<String>) -> Self {
        let mut r = Rejection::new(429, "saturated", message);
        r.queue_at = Some(priority);
        r
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
            PickError::Saturated(_) if is_sheddable(priority) => Rejection::saturated(
                priority,
                format!("{e}; sheddable request (priority {priority}) dropped"),
            ),
            PickError::Saturated(_) => Rejection::saturated(priority, e.to_string()),
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

/// How a front door wants a saturated pool to treat the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Admit {
    /// Shed sheddable requests (429) when every eligible endpoint is saturated; route the others
    /// anyway (no flow control).
    #[default]
    Shed,
    /// Only to an endpoint that is not saturated; otherwise a `saturated` rejection carrying the
    /// priority, which flow control turns into a place in its queue.
    Unsaturated,
    /// Resolve the request (model, objective, priority) but do not pick: others are queued already
    /// and a new arrival must not overtake them. Always a `saturated` rejection.
    Hold,
}

/// What the proxy said about a request besides its body.
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteHints<'a> {
    /// The proxy's subset hint: when `Some`, only these endpoints may be picked.
    pub subset: Option<&'a [SocketAddr]>,
    /// The InferenceObjective the request names (`x-llm-d-inference-objective`).
    pub objective: Option<&'a str>,
    pub admit: Admit,
    /// Report every candidate's score with the pick.
    pub scores: bool,
}

/// A routed request: the core's pick and booking, and what the front door must change.
#[derive(Debug)]
pub struct Routed {
    pub pick: Pick,
    pub mode: PrefixMode,
    /// Released when dropped (end of the response, abort, or the stream going away).
    pub booking: Booking,
    /// Where the `model` value is in the body and what it becomes, when it must be rewritten.
    pub rewrite: Option<(Range<usize>, Arc<str>)>,
    /// Metric labels: the InferenceModel (or `none`/`unlisted`) and the target model.
    pub model_label: Arc<str>,
    pub target_label: Arc<str>,
    /// Picks made again because the chosen endpoint's load changed before its booking.
    pub repicks: u32,
}

/// What the front doors call to route one request.
pub trait RouteRequest: Send + Sync + std::fmt::Debug {
    /// Routes a request with `body` (None: decided at the headers, no model) among the pool's
    /// ready endpoints, restricted to the hints' subset when the proxy sent one.
    fn route(&self, body: Option<&[u8]>, hints: &RouteHints<'_>) -> Result<Routed, Rejection>;

    /// Whether some ready endpoint is below its saturation limits (flow control dispatches a
    /// queued request only then).
    fn has_capacity(&self) -> bool;

    /// The ready endpoint at `addr` (the proxy reported it served the request).
    fn endpoint(&self, addr: SocketAddr) -> Option<Arc<Endpoint>>;
}

/// [`RouteRequest`] over the pool's datastore and the core's [`Router`].
#[derive(Debug)]
pub struct RequestRouter {
    store: Arc<Datastore>,
    router: Arc<Router>,
    /// Tokenizers by served model name (the KV-aware picker's `tokens` mode).
    tokenizers: std::collections::HashMap<String, Arc<ModelTokenizer>>,
    /// Route models with no InferenceModel as Standard instead of rejecting them (404).
    pass_through_unknown: bool,
    /// Metric labels, allocated once: requests without a body, and models with no InferenceModel.
    no_model: Arc<str>,
    unlisted_model: Arc<str>,
}

impl RequestRouter {
    pub fn new(store: Arc<Datastore>, router: Arc<Router>, pass_through_unknown: bool) -> Self {
        RequestRouter {
            store,
            router,
            tokenizers: Default::default(),
            pass_through_unknown,
            no_model: "none".into(),
            unlisted_model: UNLISTED_MODEL_LABEL.into(),
        }
    }

    /// Tokenizes prompts for `model` (served name) with `tokenizer`.
    pub fn with_tokenizer(mut self, model: String, tokenizer: Arc<ModelTokenizer>) -> Self {
        self.tokenizers.insert(model, tokenizer);
        self
    }
}

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
            None if self.pass_through_unknown => Ok(0),
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

    fn context(&self, hints: &RouteHints<'_>) -> PickContext {
        let ctx = PickContext::new(fastrand::Rng::new(), Instant::now());
        if hints.scores {
            ctx.with_scores()
        } else {
            ctx
        }
    }
}

/// The core's admission for a front door's wish (`Hold` never reaches the core).
fn admission(admit: Admit) -> Admission {
    match admit {
        Admit::Shed => Admission::Shed,
        Admit::Unsaturated | Admit::Hold => Admission::Unsaturated,
    }
}

impl RouteRequest for RequestRouter {
    fn route(&self, body: Option<&[u8]>, hints: &RouteHints<'_>) -> Result<Routed, Rejection> {
        let snap = self.store.snapshot();
        if snap.pool.is_none() {
            let t = self.store.target();
            return Err(Rejection::new(
                503,
                "pool_not_found",
                format!("InferencePool {}/{} is not known yet", t.namespace, t.name),
            ));
        }
        let held = |priority: i32| {
            Rejection::saturated(priority, "other requests are waiting for capacity")
        };
        let mut ctx = self.context(hints);
        let Some(body) = body else {
            let priority = self.priority(&snap.objectives, hints.objective, 0)?;
            if hints.admit == Admit::Hold {
                return Err(held(priority));
            }
            let facts = RequestFacts {
                subset: hints.subset,
                priority,
                admission: admission(hints.admit),
                ..RequestFacts::default()
            };
            let d = self
                .router
                .route(facts, &snap.endpoints, &mut ctx)
                .map_err(|e| Rejection::from_pick(e, priority))?;
            return Ok(Routed {
                pick: d.pick,
                mode: d.mode,
                booking: d.booking,
                repicks: d.repicks,
                rewrite: None,
                model_label: self.no_model.clone(),
                target_label: self.no_model.clone(),
            });
        };
        let mut parsed = parse_body(body)?;
        let unlisted = self.pass_through_unknown.then_some(&self.unlisted_model);
        let m = match resolve_model(&snap, &parsed.model, unlisted) {
            Ok(m) => m,
            Err(e @ ModelError::Unknown(_)) => {
                let mut r = Rejection::new(404, "unknown_model", e.to_string());
                r.labels = Some((self.unlisted_model.clone(), self.unlisted_model.clone()));
                return Err(r);
            }
        };
        let labels = (m.model_label.clone(), m.target_label.clone());
        let with_labels = |mut r: Rejection| {
            r.labels = Some(labels.clone());
            r
        };
        let priority = self
            .priority(&snap.objectives, hints.objective, m.criticality.priority())
            .map_err(with_labels)?;
        if hints.admit == Admit::Hold {
            return Err(with_labels(held(priority)));
        }
        let served = m.rewrite_to.as_deref().unwrap_or(&parsed.model);
        let prompt = if self.router.wants_prompt() {
            prompt_for_routing(
                self.tokenizers.get(served).map(|t| &**t),
                prompt_input(parsed.messages, parsed.prompt.take()),
                served,
                &m.target_label,
            )
        } else {
            kvepp_core::Prompt::None
        };
        let facts = RequestFacts {
            model: Some(served),
            priority,
            admission: admission(hints.admit),
            subset: hints.subset,
            prompt,
            booking_id: None,
            prefill_tokens: None,
        };
        let d = self
            .router
            .route(facts, &snap.endpoints, &mut ctx)
            .map_err(|e| with_labels(Rejection::from_pick(e, priority)))?;
        Ok(Routed {
            pick: d.pick,
            mode: d.mode,
            booking: d.booking,
            repicks: d.repicks,
            rewrite: m.rewrite_to.clone().map(|t| (parsed.model_span.clone(), t)),
            model_label: labels.0,
            target_label: labels.1,
        })
    }

    fn has_capacity(&self) -> bool {
        let snap = self.store.snapshot();
        self.router.has_capacity(&snap.endpoints, Instant::now())
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
