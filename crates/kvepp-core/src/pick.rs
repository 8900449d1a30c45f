//! Endpoint selection: which endpoints may serve a request, whether the pool must shed it, and which
//! one serves it (with a second-best fallback).
//!
//! Callers pass the ready endpoints of the pool, a [`PickRequest`] and a [`PickContext`] (their
//! randomness and time). The [`Picker`] trait is the extension point: the KV-aware picker
//! ([`crate::KvPicker`]), least loaded and round robin implement it. Front doors do not call this
//! directly but [`crate::Router::route`], which also hashes the prompt and books the pick.
//!
//! Invariants:
//! - a pick only ever names an endpoint from the candidates (after the subset filter);
//! - the fallback, when present, differs from the primary;
//! - a sheddable request (priority below 0) is refused only when every candidate is saturated;
//! - a request admitted with [`Admission::Unsaturated`] only ever goes to a candidate that is not
//!   saturated (flow control queues it otherwise);
//! - scores, when asked for, are higher for better candidates and in `[0, 1]`;
//! - a request's adapter adds one cost term per candidate ([`crate::affinity::adapters`]), and its
//!   session's bound rank is chosen only while it is a candidate here and not saturated.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::affinity::{AdapterAffinity, AdapterFit};
use crate::cost::KvDecision;
pub use crate::endpoint::Endpoint;
use crate::types::{PromptBlocks, WorkerRank};

/// How important a request is (InferenceModel `spec.criticality`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Criticality {
    Critical,
    #[default]
    Standard,
    Sheddable,
}

impl Criticality {
    /// The InferenceObjective priority this criticality stands for: Critical 1, Standard 0,
    /// Sheddable -1 (negative priorities are sheddable, as in the Inference Extension's v1 API).
    pub fn priority(self) -> i32 {
        match self {
            Criticality::Critical => 1,
            Criticality::Standard => 0,
            Criticality::Sheddable => -1,
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "Critical" => Some(Self::Critical),
            "Standard" => Some(Self::Standard),
            "Sheddable" => Some(Self::Sheddable),
            _ => None,
        }
    }
}

/// How a request is admitted when endpoints are saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Admission {
    /// Shed only sheddable requests (priority < 0) when every candidate is saturated; others go
    /// to the best candidate whatever its load.
    #[default]
    Shed,
    /// Only candidates that are not saturated; none: [`PickError::Saturated`] whatever the
    /// priority (flow control then queues the request).
    Unsaturated,
}

/// Whether requests of `priority` may be shed (the Inference Extension's rule: negative).
pub fn is_sheddable(priority: i32) -> bool {
    priority < 0
}

/// What the selector needs to know about one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct PickRequest<'a> {
    /// InferenceObjective priority (higher is more important; negative is sheddable).
    pub priority: i32,
    pub admission: Admission,
    /// The proxy's subset hint: when `Some`, only these endpoints may be picked.
    pub subset: Option<&'a [SocketAddr]>,
    /// The prompt as KV blocks, when the request has one.
    pub prompt: Option<&'a PromptBlocks>,
    /// Extra cost per endpoint (in the order of the endpoints picked among), added to the
    /// picker's own: a decode pick's KV-transfer cost. Empty: none.
    pub bias: &'a [f64],
    /// The LoRA adapter the request runs with (None: the base model): adds each candidate's
    /// adapter term ([`crate::affinity::adapters`]).
    pub adapter: Option<&'a str>,
    /// The rank the request's session is bound to: picked while it is a candidate (after the
    /// subset and role filters) and not saturated.
    pub sticky: Option<WorkerRank>,
    /// The time to first token the request may still spend (its TTFT objective less what it
    /// waited already), in ms. Under a predicted cost, candidates predicted slower are passed
    /// over while one meets it (and the TPOT objective); under [`Admission::Unsaturated`] a
    /// choice predicted slower fails with [`PickError::OverObjective`] (flow control holds the
    /// request until an endpoint can meet it, or rejects it). None: no objective.
    pub ttft_budget_ms: Option<f64>,
    /// The request's time-per-output-token objective, in ms: under a predicted cost,
    /// candidates predicted to decode slower are passed over while one meets it; under
    /// [`Admission::Unsaturated`] a choice predicted slower fails with
    /// [`PickError::OverTpotObjective`]. None: no objective.
    pub tpot_budget_ms: Option<f64>,
    /// The model the engine serves the request with (its learned output length is the
    /// request's when it gives no `max_tokens`).
    pub model: Option<&'a str>,
    /// The request's `max_tokens` (`max_completion_tokens`), when it gives one.
    pub max_tokens: Option<u64>,
    /// An identity the caller gives its endpoint list: one value only ever names the same
    /// endpoints in the same order (a pool snapshot's serial number), so a picker that keeps
    /// state per list ([`crate::KvPicker`]'s roster) recognises it without reading it. The
    /// selector withholds it from the picker whenever it narrows the list. None: none.
    pub list: Option<u64>,
}

/// A disaggregated pick's prefill leg: where the prompt is prefilled before the decode worker
/// (the pick's primary) takes over. The KV-aware reasons for the prefill worker are the pick's
/// `kv`.
#[derive(Debug, Clone)]
pub struct Pairing {
    pub prefill: Arc<Endpoint>,
    /// The configured level's value on each side (None: no level configured, or the worker
    /// lacks it).
    pub prefill_domain: Option<String>,
    pub decode_domain: Option<String>,
    /// The decode worker is outside the prefill worker's domain (fallback policy).
    pub crossed: bool,
    /// Estimated transfer time between the two, in milliseconds (the QoS table).
    pub transfer_ms: f64,
}

impl<'a> PickRequest<'a> {
    /// This request for a picker ranking `candidates` out of the caller's `endpoints`: the
    /// list's identity holds only for the list as given.
    fn narrowed_to(&self, candidates: &[Arc<Endpoint>], endpoints: &[Arc<Endpoint>]) -> Self {
        let same = candidates.as_ptr() == endpoints.as_ptr() && candidates.len() == endpoints.len();
        PickRequest {
            list: self.list.filter(|_| same),
            ..*self
        }
    }

    /// A request with `prompt` and nothing else (benchmarks and tests of a picker alone).
    pub fn prompt(prompt: Option<&'a PromptBlocks>) -> Self {
        PickRequest {
            prompt,
            ..PickRequest::default()
        }
    }
}

/// The outcome of a successful pick.
#[derive(Debug, Clone)]
pub struct Pick {
    pub primary: Arc<Endpoint>,
    pub fallback: Option<Arc<Endpoint>>,
    /// The KV-aware picker's reasons (None for load-only pickers).
    pub kv: Option<KvDecision>,
    /// Every candidate's score (`[0, 1]`, higher is better), when the context asked for them.
    pub scores: Option<Vec<(Arc<Endpoint>, f64)>>,
    /// In a disaggregated pool, the prefill worker that hands its KV cache to the primary.
    pub pairing: Option<Pairing>,
    /// How the primary fit the request's adapter (None: no adapter).
    pub adapter: Option<AdapterFit>,
    /// Candidates the cost ranked (after the subset, role and admission filters).
    pub candidates: u32,
}

/// The endpoints the proxy's subset hint names (none named, or none of them ready: an error).
fn in_subset(
    endpoints: &[Arc<Endpoint>],
    subset: &[SocketAddr],
) -> Result<Vec<Arc<Endpoint>>, PickError> {
    if subset.is_empty() {
        return Err(PickError::EmptySubset);
    }
    let filtered: Vec<Arc<Endpoint>> = endpoints
        .iter()
        .filter(|e| subset.contains(&e.addr))
        .cloned()
        .collect();
    if filtered.is_empty() {
        return Err(PickError::NoEligibleInSubset(subset.len()));
    }
    Ok(filtered)
}

/// The objectives' filter: under [`Admission::Unsaturated`], a choice predicted (by a predicted
/// cost, in ms) to exceed the request's TTFT budget or its time-per-output-token objective is
/// refused. Dynamo's cost predicts no time and is never refused.
fn over_objective(req: &PickRequest<'_>, kv: Option<&KvDecision>) -> Option<PickError> {
    if req.admission != Admission::Unsaturated {
        return None;
    }
    let o = kv?.objective?;
    let ms = |v: f64| v.max(0.0).round() as u64;
    let us = |v: f64| (v.max(0.0) * 1000.0).round() as u64;
    if let Some(budget) = req.ttft_budget_ms.filter(|b| o.predicted_ms > *b) {
        return Some(PickError::OverObjective {
            predicted_ms: ms(o.predicted_ms),
            budget_ms: ms(budget),
            floor_ms: ms(o.floor_ms),
        });
    }
    let itl = o.itl_ms?;
    req.tpot_budget_ms
        .filter(|b| itl > *b)
        .map(|budget| PickError::OverTpotObjective {
            predicted_us: us(itl),
            budget_us: us(budget),
            floor_us: us(o.itl_floor_ms.unwrap_or(itl)),
        })
}

/// A picker's answer: best candidate, second best (if any), and its KV reasons.
#[derive(Debug, Clone, Copy)]
pub struct Ranked {
    pub best: usize,
    pub second: Option<usize>,
    pub kv: Option<KvDecision>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PickError {
    #[error("no ready endpoints in the pool")]
    NoReadyEndpoints,
    #[error("the subset hint is empty")]
    EmptySubset,
    #[error("none of the {0} endpoints in the subset hint is ready in the pool")]
    NoEligibleInSubset(usize),
    #[error("all {0} eligible endpoints are saturated")]
    Saturated(usize),
    /// No endpoint is predicted to give the first token within the budget left; `floor_ms`: the
    /// least any candidate would take idle (above the budget, waiting cannot help).
    #[error("the best endpoint's predicted time to first token, {predicted_ms} ms, exceeds the {budget_ms} ms left of the request's TTFT objective (idle, the fastest would take {floor_ms} ms)")]
    OverObjective {
        predicted_ms: u64,
        budget_ms: u64,
        floor_ms: u64,
    },
    /// No endpoint is predicted to decode within the request's time-per-output-token objective
    /// (`floor_us`: what an idle endpoint is predicted to take).
    #[error("the best endpoint's predicted time per output token, {:.1} ms, exceeds the request's {:.1} ms objective (an idle endpoint: {:.1} ms)", *.predicted_us as f64 / 1000.0, *.budget_us as f64 / 1000.0, *.floor_us as f64 / 1000.0)]
    OverTpotObjective {
        predicted_us: u64,
        budget_us: u64,
        floor_us: u64,
    },
    #[error("no ready decode endpoint in the disaggregated pool")]
    NoDecodeEndpoints,
    #[error("booking id {0:?} is already active")]
    DuplicateBooking(String),
    #[error("no decode worker in the prefill worker {prefill}'s {level} {}; kv_transfer_mismatch_policy is fail", .domain.as_deref().map_or_else(|| "(it has no such topology domain)".to_owned(), |d| format!("{d:?}")))]
    TopologyMismatch {
        level: String,
        /// The prefill worker's value of the level (None: it has none).
        domain: Option<String>,
        prefill: String,
    },
}

/// What a pick takes from the outside world: randomness (ties, temperature sampling) and the
/// time. The caller provides both, so the core holds no global RNG or clock and tests are
/// deterministic.
#[derive(Debug, Clone)]
pub struct PickContext {
    pub rng: fastrand::Rng,
    pub now: Instant,
    /// `Some`: the picker writes every candidate's score here (one per candidate, in order).
    pub scores: Option<Vec<f64>>,
    /// The pick's buffer for [`PickRequest::bias`] as it applies to the candidates left after
    /// the filters (what the picker reads); empty outside a pick.
    pub bias: Vec<f64>,
}

impl PickContext {
    /// `rng` for the random choices, `now` as the time of the pick.
    pub fn new(rng: fastrand::Rng, now: Instant) -> Self {
        PickContext {
            rng,
            now,
            scores: None,
            bias: Vec::new(),
        }
    }

    /// Asks the picker for every candidate's score (see [`Pick::scores`]).
    pub fn with_scores(mut self) -> Self {
        self.scores = Some(Vec::new());
        self
    }

    /// A reproducible context (tests, benchmarks): seeded RNG, the current instant.
    pub fn seeded(seed: u64) -> Self {
        PickContext::new(fastrand::Rng::with_seed(seed), Instant::now())
    }
}

/// Extension point: ranks candidates: the index of the best candidate and, if there is more than
/// one candidate, the index of the second best. `candidates` is never empty. When `ctx.scores` is
/// `Some`, the picker fills it with one score per candidate in `[0, 1]`, higher for better.
pub trait Picker: Send + Sync + std::fmt::Debug {
    fn rank(
        &self,
        candidates: &[Arc<Endpoint>],
        req: &PickRequest<'_>,
        ctx: &mut PickContext,
    ) -> Ranked;

    /// The picker's cost per millisecond of expected delay (what an adapter load weighs); None:
    /// the picker weighs no delays (load-only pickers), so adapters do not enter its choice.
    fn cost_per_ms(&self) -> Option<f64> {
        None
    }
}

/// When an endpoint counts as saturated: too many requests in flight through us, or, once its
/// engine metrics have been scraped, a long queue, a full KV cache, or metrics gone stale.
#[derive(Debug, Clone, Copy, Default)]
pub struct Saturation {
    /// In-flight requests at which an endpoint is saturated; 0 disables the check.
    pub max_in_flight: u32,
    /// `vllm:num_requests_waiting` at which an engine is saturated; 0 disables the check.
    pub queue_threshold: u32,
    /// `vllm:kv_cache_usage_perc` at which an engine is saturated; ≥ 1 never triggers below 100%.
    pub kv_cache_threshold: f64,
    /// Scraped metrics older than this make the engine count as saturated; None disables.
    pub stale_after: Option<std::time::Duration>,
}

impl Saturation {
    /// Only the in-flight rule.
    pub fn in_flight(max_in_flight: u32) -> Self {
        Saturation {
            max_in_flight,
            kv_cache_threshold: f64::INFINITY,
            ..Saturation::default()
        }
    }

    /// Whether `ep` is saturated at `now`.
    pub fn is_saturated(&self, ep: &Endpoint, now: Instant) -> bool {
        self.saturated_at(ep, crate::load::clock_nanos(now))
    }

    /// [`Self::is_saturated`] with `now` converted once for a whole candidate list.
    fn saturated_at(&self, ep: &Endpoint, now: i64) -> bool {
        if self.max_in_flight > 0 && ep.load.in_flight() >= self.max_in_flight {
            return true;
        }
        // An engine never scraped (or not a vLLM engine) is judged by the in-flight rule alone.
        let Some((waiting, kv_cache_usage, age)) = ep.load.saturation_inputs_at(now) else {
            return false;
        };
        self.stale_after.is_some_and(|s| age > s)
            || (self.queue_threshold > 0 && waiting >= f64::from(self.queue_threshold))
            || kv_cache_usage >= self.kv_cache_threshold
    }
}

/// What a selector judges by besides its picker's cost: when an endpoint is saturated and what
/// a request's adapter weighs. Replaced as a whole while the selector runs; each pick reads it
/// once.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tuning {
    pub saturation: Saturation,
    pub adapters: AdapterAffinity,
}

/// Eligibility, shedding and picking, in that order.
#[derive(Debug)]
pub struct Selector {
    picker: Box<dyn Picker>,
    tuning: arc_swap::ArcSwap<Tuning>,
}

impl Selector {
    pub fn new(picker: Box<dyn Picker>, saturation: Saturation) -> Self {
        Selector {
            picker,
            tuning: arc_swap::ArcSwap::from_pointee(Tuning {
                saturation,
                adapters: AdapterAffinity::default(),
            }),
        }
    }

    /// Whether and how much the request's adapter weighs in the choice.
    pub fn with_adapter_affinity(self, adapters: AdapterAffinity) -> Self {
        self.retune(Tuning {
            adapters,
            ..self.tuning()
        });
        self
    }

    /// The saturation limits and adapter weights picks use now.
    pub fn tuning(&self) -> Tuning {
        **self.tuning.load()
    }

    /// Replaces them: picks that start afterwards use the new ones.
    pub fn retune(&self, tuning: Tuning) {
        self.tuning.store(Arc::new(tuning));
    }

    pub fn pick(
        &self,
        endpoints: &[Arc<Endpoint>],
        req: &PickRequest<'_>,
        ctx: &mut PickContext,
    ) -> Result<Pick, PickError> {
        if endpoints.is_empty() {
            return Err(PickError::NoReadyEndpoints);
        }
        // The pool's own list when nothing filters it (the common case: no copy); a filtered
        // copy otherwise.
        let filtered: Vec<Arc<Endpoint>>;
        let mut candidates: &[Arc<Endpoint>] = match req.subset {
            None => endpoints,
            Some(subset) => {
                filtered = in_subset(endpoints, subset)?;
                &filtered
            }
        };
        let eligible = candidates.len();
        let unsaturated: Vec<Arc<Endpoint>>;
        let now = crate::load::clock_nanos(ctx.now);
        let tuning = self.tuning();
        let saturation = &tuning.saturation;
        match req.admission {
            Admission::Unsaturated => {
                // Copied (one reference count per candidate) only when some candidate is
                // saturated: the common case reads each once and picks from the list as it is.
                let saturated = |e: &Arc<Endpoint>| saturation.saturated_at(e, now);
                if let Some(first) = candidates.iter().position(saturated) {
                    unsaturated = candidates[..first]
                        .iter()
                        .chain(candidates[first + 1..].iter().filter(|e| !saturated(e)))
                        .cloned()
                        .collect();
                    if unsaturated.is_empty() {
                        return Err(PickError::Saturated(eligible));
                    }
                    candidates = &unsaturated;
                }
            }
            Admission::Shed => {
                if is_sheddable(req.priority)
                    && candidates.iter().all(|e| saturation.saturated_at(e, now))
                {
                    return Err(PickError::Saturated(eligible));
                }
            }
        }
        ctx.bias.clear();
        if candidates.len() == endpoints.len() {
            ctx.bias.extend_from_slice(req.bias);
        } else if !req.bias.is_empty() {
            // The bias follows `endpoints`; keep each surviving candidate's own.
            ctx.bias.extend(candidates.iter().map(|c| {
                endpoints
                    .iter()
                    .position(|e| Arc::ptr_eq(e, c))
                    .and_then(|i| req.bias.get(i).copied())
                    .unwrap_or(0.0)
            }));
        }
        self.adapter_terms(&tuning, candidates, req.adapter, now, &mut ctx.bias);
        let req = &req.narrowed_to(candidates, endpoints);
        let mut r = self.picker.rank(candidates, req, ctx);
        let sticky = req
            .sticky
            .and_then(|s| candidates.iter().position(|c| c.rank() == s))
            .filter(|&i| i != r.best && !saturation.saturated_at(&candidates[i], now));
        if let Some(i) = sticky {
            // The bound endpoint's own decision (what its booking needs); the cheapest is its
            // fallback. Scores, when asked for, stay those of every candidate.
            let scores = ctx.scores.take();
            let b = ctx.bias.get(i).copied();
            ctx.bias.clear();
            ctx.bias.extend(b);
            let alone = &candidates[i..=i];
            let one = self
                .picker
                .rank(alone, &req.narrowed_to(alone, candidates), ctx);
            ctx.scores = scores;
            r = Ranked {
                best: i,
                second: Some(r.best),
                kv: one.kv,
            };
        }
        if let Some(e) = over_objective(req, r.kv.as_ref()) {
            ctx.bias.clear();
            return Err(e);
        }
        let primary = candidates[r.best].clone();
        let adapter = req.adapter.map(|a| {
            let slots = primary.load.adapters.load();
            let recent = primary.load.recent_adapters.load();
            let saturated = saturation.saturated_at(&primary, now);
            AdapterAffinity::fit(slots.as_deref(), &recent, a, saturated)
        });
        let fallback = r
            .second
            .filter(|&i| i != r.best)
            .map(|i| candidates[i].clone());
        let scores = ctx.scores.as_mut().map(|s| {
            candidates
                .iter()
                .zip(s.drain(..))
                .map(|(e, v)| (Arc::clone(e), v))
                .collect()
        });
        ctx.bias.clear();
        Ok(Pick {
            candidates: u32::try_from(candidates.len()).unwrap_or(u32::MAX),
            primary,
            fallback,
            kv: r.kv,
            scores,
            pairing: None,
            adapter,
        })
    }

    /// Adds each candidate's adapter term to `bias` (in the picker's unit) when the request has
    /// an adapter, adapter affinity is on and the picker weighs delays.
    fn adapter_terms(
        &self,
        tuning: &Tuning,
        candidates: &[Arc<Endpoint>],
        adapter: Option<&str>,
        now: i64,
        bias: &mut Vec<f64>,
    ) {
        let Some(adapter) = adapter.filter(|_| tuning.adapters.enabled) else {
            return;
        };
        let Some(scale) = self.picker.cost_per_ms() else {
            return;
        };
        bias.resize(candidates.len(), 0.0);
        for (b, c) in bias.iter_mut().zip(candidates) {
            let slots = c.load.adapters.load();
            let recent = c.load.recent_adapters.load();
            let saturated = tuning.saturation.saturated_at(c, now);
            let fit = AdapterAffinity::fit(slots.as_deref(), &recent, adapter, saturated);
            *b += scale * tuning.adapters.cost_ms(fit);
        }
    }

    /// Whether any of `endpoints` is not saturated at `now` (flow control's capacity check).
    pub fn has_capacity<'a>(
        &self,
        endpoints: impl IntoIterator<Item = &'a Arc<Endpoint>>,
        now: Instant,
    ) -> bool {
        let now = crate::load::clock_nanos(now);
        let saturation = self.tuning().saturation;
        endpoints
            .into_iter()
            .any(|e| !saturation.saturated_at(e, now))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::LeastLoaded;

    pub fn ep(port: u16, in_flight: u32) -> Arc<Endpoint> {
        let ep = Arc::new(Endpoint::new(
            ([127, 0, 0, 1], port).into(),
            format!("pod-{port}"),
        ));
        for _ in 0..in_flight {
            std::mem::forget(ep.load.book());
        }
        ep
    }

    /// `Selector::pick` with a seeded context.
    trait PickT {
        fn pick_t(&self, eps: &[Arc<Endpoint>], req: &PickRequest<'_>) -> Result<Pick, PickError>;
    }

    impl PickT for Selector {
        fn pick_t(&self, eps: &[Arc<Endpoint>], req: &PickRequest<'_>) -> Result<Pick, PickError> {
            self.pick(eps, req, &mut PickContext::seeded(1))
        }
    }

    fn selector(max: u32) -> Selector {
        Selector::new(Box::new(LeastLoaded), Saturation::in_flight(max))
    }

    #[test]
    fn empty_pool_is_503_material() {
        assert_eq!(
            selector(0)
                .pick_t(&[], &PickRequest::default())
                .unwrap_err(),
            PickError::NoReadyEndpoints
        );
    }

    #[test]
    fn subset_filters_and_errors() {
        let eps = vec![ep(1, 0), ep(2, 5), ep(3, 9)];
        let s = selector(0);
        let only: Vec<SocketAddr> = vec![eps[2].addr, ([10, 0, 0, 1], 3).into()];
        let req = PickRequest {
            subset: Some(&only),
            ..Default::default()
        };
        let p = s.pick_t(&eps, &req).unwrap();
        assert_eq!(p.primary.addr, eps[2].addr);
        assert!(p.fallback.is_none(), "one candidate, no fallback");
        let none: Vec<SocketAddr> = vec![([10, 0, 0, 1], 3).into()];
        assert_eq!(
            s.pick_t(
                &eps,
                &PickRequest {
                    subset: Some(&none),
                    ..Default::default()
                }
            )
            .unwrap_err(),
            PickError::NoEligibleInSubset(1)
        );
        assert_eq!(
            s.pick_t(
                &eps,
                &PickRequest {
                    subset: Some(&[]),
                    ..Default::default()
                }
            )
            .unwrap_err(),
            PickError::EmptySubset
        );
    }

    #[test]
    fn sheddable_dropped_only_when_all_saturated() {
        let eps = vec![ep(1, 4), ep(2, 4)];
        let s = selector(4);
        let shed = PickRequest {
            priority: Criticality::Sheddable.priority(),
            ..Default::default()
        };
        assert_eq!(s.pick_t(&eps, &shed).unwrap_err(), PickError::Saturated(2));
        for c in [Criticality::Standard, Criticality::Critical] {
            assert!(s
                .pick_t(
                    &eps,
                    &PickRequest {
                        priority: c.priority(),
                        ..Default::default()
                    }
                )
                .is_ok());
        }
        let eps = vec![ep(1, 4), ep(2, 3)];
        assert_eq!(s.pick_t(&eps, &shed).unwrap().primary.addr, eps[1].addr);
        // Disabled limit never sheds.
        assert!(selector(0).pick_t(&[ep(1, 1000)], &shed).is_ok());
    }

    #[test]
    fn unsaturated_admission_skips_saturated_endpoints_whatever_the_priority() {
        let s = selector(4);
        let req = PickRequest {
            priority: 10,
            admission: Admission::Unsaturated,
            ..Default::default()
        };
        // The least loaded endpoint is saturated at 4 too: only the free one may be picked.
        let eps = vec![ep(1, 4), ep(2, 5), ep(3, 3)];
        for _ in 0..20 {
            assert_eq!(s.pick_t(&eps, &req).unwrap().primary.addr, eps[2].addr);
        }
        // Saturated ones (the least loaded among them, by their engines' KV-cache usage) between
        // free ones: neither the pick nor its fallback is one of them.
        let by_cache = Selector::new(
            Box::new(LeastLoaded),
            Saturation {
                kv_cache_threshold: 0.8,
                ..Saturation::in_flight(4)
            },
        );
        let full_cache = crate::load::EngineMetrics {
            kv_cache_usage: 0.9,
            ..crate::load::EngineMetrics::default()
        };
        let mixed = vec![ep(1, 3), ep(2, 0), ep(3, 1), ep(4, 2), ep(5, 6)];
        for e in &mixed[1..3] {
            e.load.engine_update(full_cache, Instant::now());
        }
        for _ in 0..20 {
            let p = by_cache.pick_t(&mixed, &req).unwrap();
            assert_eq!(p.primary.addr, mixed[3].addr);
            assert_eq!(p.fallback.map(|f| f.addr), Some(mixed[0].addr));
        }
        let full = vec![ep(1, 4), ep(2, 4)];
        assert_eq!(s.pick_t(&full, &req).unwrap_err(), PickError::Saturated(2));
        assert!(!s.has_capacity(&full, Instant::now()));
        assert!(s.has_capacity(&eps, Instant::now()));
        // The default admission still routes a non-sheddable request to a saturated pool.
        let shed_rule = PickRequest {
            priority: 10,
            ..Default::default()
        };
        assert!(s.pick_t(&full, &shed_rule).is_ok());
    }

    #[test]
    fn scores_are_one_per_candidate_and_best_for_the_pick() {
        let eps = vec![ep(1, 3), ep(2, 1), ep(3, 2)];
        let mut ctx = PickContext::seeded(3).with_scores();
        let p = selector(0)
            .pick(&eps, &PickRequest::default(), &mut ctx)
            .unwrap();
        let scores = p.scores.expect("asked for");
        assert_eq!(scores.len(), 3);
        let best = scores
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(e, _)| e.addr);
        assert_eq!(best, Some(p.primary.addr));
        assert!(scores.iter().all(|(_, v)| (0.0..=1.0).contains(v)));
        let unasked = selector(0).pick_t(&eps, &PickRequest::default()).unwrap();
        assert!(unasked.scores.is_none());
    }

    #[test]
    fn fallback_differs_from_primary() {
        let eps = vec![ep(1, 3), ep(2, 1), ep(3, 2)];
        for _ in 0..50 {
            let p = selector(0).pick_t(&eps, &PickRequest::default()).unwrap();
            assert_eq!(p.primary.addr, eps[1].addr);
            assert_eq!(p.fallback.unwrap().addr, eps[2].addr);
        }
    }
}
