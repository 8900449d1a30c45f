//! The KV-aware cost of sending a request to a worker rank (Dynamo's current formula) and the
//! choice among ranks.
//!
//! For each eligible rank, with `block_size` tokens per block:
//! - `prefill_blocks = potential_prefill_tokens / block_size` (active prefill plus this prompt);
//! - `overlap_credit = overlap_score_credit·device + host_w·(host − device) + disk_w·(disk − host)`,
//!   where device ≤ host ≤ disk are the cumulative cached-prefix lengths in blocks per tier;
//! - `cost = prefill_load_scale · max(0, prefill_blocks − overlap_credit) + potential_decode_blocks
//!   + decode_active_request_weight · active_requests`.
//!
//! Temperature 0 picks the cheapest (ties to the fewest requests in flight, then to the endpoint
//! booked least recently, so equal-cost picks such as new prefixes on idle engines take turns,
//! then at random); above 0 it samples a softmax over the normalised negative costs. What a pick books as prefill is `effective_prefill_tokens`.
//!
//! kvepp's own addition, bounded loads ([`CostWeights::bound_loads`]; on in the EPP's defaults,
//! off in Dynamo's, [`CostWeights::dynamo`]): before the choice, candidates that would hold more than `load_bound` × the mean number
//! of requests (this one included, rounded up) cost more than every candidate within the bound,
//! so requests the cache does not tie to one engine spread by count, and a popular prefix spills
//! over to the next best engine instead of queueing on one. A candidate holding at least
//! `load_bound_exempt_cached` of the prompt more than the candidate holding least (so a prefix
//! every candidate holds exempts none) is exempt from that bound, but not from
//! `load_bound_cached` when set (a looser bound, ≥ `load_bound`, for the engines the cache ties the
//! request to: the holder of a hot prefix keeps it until it would hold more than
//! `load_bound_cached` × the mean, then a second engine takes the prefix over). The least loaded
//! candidate is always within both bounds, so the choice never runs out of candidates.

pub use crate::types::Overlap;

/// What the picker decided for the chosen candidate (logged at debug level, booked).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvDecision {
    pub mode: crate::types::PrefixMode,
    /// Full KV blocks in the prompt.
    pub prompt_blocks: u64,
    pub overlap: Overlap,
    pub cost: f64,
    pub effective_prefill_tokens: u64,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u32,
    /// The chosen rank's load version when it was read (None: not registered yet): a booking
    /// checked against it books exactly the load this decision saw.
    pub load_version: Option<u64>,
    /// Bounded loads ([`CostWeights::bound_loads`]) passed over a cheaper candidate that held
    /// more than its share of requests.
    pub load_bounded: bool,
    /// The request's objectives (TTFT, TPOT) passed over a cheaper candidate predicted to miss
    /// them.
    pub objective_filtered: bool,
    /// Under a predicted cost model: what the chosen endpoint's TTFT prediction read (its
    /// booking learns from the observed first token).
    pub ttft: Option<crate::predict::TtftFeatures>,
    /// Under a predicted cost model: what the chosen endpoint's decode prediction read (its
    /// booking learns from the observed end of the response).
    pub decode: Option<crate::decode::DecodeFeatures>,
    /// Under a predicted cost model, for a request with a TTFT or TPOT objective: what the
    /// objectives' filter reads.
    pub objective: Option<crate::predict::TtftOutlook>,
}

/// What the cost model needs to know about one rank for one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CandidateLoad {
    pub overlap: Overlap,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u32,
}

impl CandidateLoad {
    /// Takes the load part of a slot-tracker projection.
    pub fn set_load(&mut self, l: &crate::slots::PotentialLoad) {
        self.potential_prefill_tokens = l.potential_prefill_tokens;
        self.potential_decode_blocks = l.potential_decode_blocks;
        self.active_requests = l.active_requests;
    }
}

/// What the KV-aware picker minimises.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum CostModel {
    /// Dynamo's formula over blocks (this module's), as the selection service computes it.
    Dynamo,
    /// Predicted time to first token in ms, learned online per endpoint
    /// ([`crate::predict`]): queueing, the uncached prefill, decode interference and traffic
    /// the engine reports beyond ours.
    PredictedTtft,
    /// The whole request in ms: the predicted time to first token, plus its predicted decode
    /// on the candidate with it added to the running batch, plus the slowdown it adds to the
    /// streams already decoding there ([`crate::decode`]). The EPP's default: a pick that wins
    /// the first token on an engine already decoding many streams loses the completion.
    #[default]
    PredictedCompletion,
}

impl CostModel {
    /// Whether the cost is a predicted time in ms, learned from the responses (not Dynamo's).
    pub fn predicts(self) -> bool {
        self != CostModel::Dynamo
    }

    /// The name used in configuration, logs and traces.
    pub fn as_str(self) -> &'static str {
        match self {
            CostModel::Dynamo => "dynamo",
            CostModel::PredictedTtft => "predicted_ttft",
            CostModel::PredictedCompletion => "predicted_completion",
        }
    }
}

/// The knobs, with Dynamo's names and defaults (in the config file: the `DYN_ROUTER_*` names in
/// lower case without the prefix, every field optional, unknown fields rejected; the variables
/// themselves are applied by kvepp's configuration loading).
#[derive(
    Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct CostWeights {
    /// `DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT` (1.0): credit per device-cached block.
    #[serde(rename = "kv_overlap_score_credit")]
    pub overlap_score_credit: f64,
    /// `DYN_ROUTER_HOST_CACHE_HIT_WEIGHT` (0.75).
    pub host_cache_hit_weight: f64,
    /// `DYN_ROUTER_DISK_CACHE_HIT_WEIGHT` (0.25).
    pub disk_cache_hit_weight: f64,
    /// `DYN_ROUTER_PREFILL_LOAD_SCALE` (1.0).
    pub prefill_load_scale: f64,
    /// `DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT` (0.0).
    pub decode_active_request_weight: f64,
    /// `DYN_ROUTER_TEMPERATURE` (0.0).
    pub temperature: f64,
    /// kvepp's own: what the EPP's picks minimise (default `predicted_completion`; `dynamo` is
    /// Dynamo's cost exactly). The HTTP selection service always uses Dynamo's.
    pub cost_model: CostModel,
    /// kvepp's own: bounded loads for the EPP's picks (0 turns it off; otherwise ≥ 1). A
    /// candidate whose requests (active there, plus those its engine reports beyond them) would
    /// exceed `load_bound` × the mean over the candidates, this request included and rounded up,
    /// is passed over while another is within the bound (`CostWeights::bound_loads`). The HTTP
    /// selection service, Dynamo's contract, does not apply it.
    pub load_bound: f64,
    /// kvepp's own: the share of the prompt's blocks (0-1) an endpoint must hold cached, beyond
    /// what the candidate holding least has, to be exempt from `load_bound` (such a hit saves at
    /// least that share of the prefill, more than an extra request in the queue costs on any
    /// workload the routing benchmark runs; a prefix every candidate holds saves nothing by going to one of
    /// them); above 1 none is.
    pub load_bound_exempt_cached: f64,
    /// kvepp's own: the bound for candidates exempt by `load_bound_exempt_cached`, as a multiple
    /// of the same mean (0, the default: they are unbounded; otherwise ≥ `load_bound` and ≥ 1).
    pub load_bound_cached: f64,
    /// kvepp's own, for prompts matched against the engines' KV events: a prompt's blocks count
    /// as cached on the endpoint a pick sent it to while that request runs there (it prefills
    /// them, and a running request's blocks stay resident), before the engine's events confirm
    /// them; a burst sharing a new prefix then lands where the first of it went. Under the
    /// predicted costs only (`CostWeights::speculates`): Dynamo's cost stays Dynamo's exactly.
    pub speculative: bool,
}

/// What bounded loads read of one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BoundInput {
    /// Requests the candidate holds.
    pub requests: u32,
    /// The prompt's blocks it holds cached (device tier). What every candidate holds does not
    /// tie the request to any of them: a candidate is exempt from `load_bound` when it holds at
    /// least `load_bound_exempt_cached` of the prompt more than the candidate holding least.
    pub cached: u64,
}

impl Default for CostWeights {
    /// The EPP's defaults (what a `router` section leaves unset): Dynamo's knobs at Dynamo's
    /// values, kvepp's cost model (predicted completion), bounded loads and speculative
    /// indexing on.
    fn default() -> Self {
        CostWeights {
            cost_model: CostModel::PredictedCompletion,
            speculative: true,
            load_bound: 1.0,
            load_bound_exempt_cached: 0.25,
            ..CostWeights::dynamo()
        }
    }
}

impl CostWeights {
    /// Dynamo's router exactly: its knobs at its defaults, its cost, no bounded loads (the HTTP
    /// selection service's, and the core's own default in [`crate::kv::KvSettings`]).
    pub fn dynamo() -> Self {
        CostWeights {
            overlap_score_credit: 1.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            temperature: 0.0,
            cost_model: CostModel::Dynamo,
            load_bound: 0.0,
            load_bound_exempt_cached: 0.5,
            load_bound_cached: 0.0,
            speculative: false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}: {message}")]
pub struct KnobError {
    pub name: &'static str,
    pub message: String,
}

impl CostWeights {
    /// Every knob must be finite and non-negative.
    pub fn validate(&self) -> Vec<KnobError> {
        [
            ("overlap_score_credit", self.overlap_score_credit),
            ("host_cache_hit_weight", self.host_cache_hit_weight),
            ("disk_cache_hit_weight", self.disk_cache_hit_weight),
            ("prefill_load_scale", self.prefill_load_scale),
            (
                "decode_active_request_weight",
                self.decode_active_request_weight,
            ),
            ("temperature", self.temperature),
            ("load_bound_exempt_cached", self.load_bound_exempt_cached),
            ("load_bound_cached", self.load_bound_cached),
        ]
        .into_iter()
        .filter(|(_, v)| !(v.is_finite() && *v >= 0.0))
        .map(|(name, v)| KnobError {
            name,
            message: format!("{v} must be a finite number ≥ 0"),
        })
        .chain(
            (!(self.load_bound == 0.0 || (self.load_bound.is_finite() && self.load_bound >= 1.0)))
                .then(|| KnobError {
                    name: "load_bound",
                    message: format!(
                        "{} must be 0 (off) or a finite number ≥ 1 (a multiple of the mean load)",
                        self.load_bound
                    ),
                }),
        )
        .chain(
            (!(self.load_bound_cached == 0.0
                || (self.load_bound_cached.is_finite()
                    && self.load_bound_cached >= self.load_bound.max(1.0))))
            .then(|| KnobError {
                name: "load_bound_cached",
                message: format!(
                    "{} must be 0 (unbounded) or a finite number ≥ 1 and ≥ load_bound ({})",
                    self.load_bound_cached, self.load_bound
                ),
            }),
        )
        .collect()
    }

    /// Whether bounded loads are on (`load_bound` ≥ 1; 0 is off).
    pub fn bounds_loads(&self) -> bool {
        self.load_bound >= 1.0
    }

    /// Bounded loads: with `inputs[i].requests` the requests candidate `i` holds, raises the cost
    /// of every candidate that would hold more than `ceil(b × (Σ requests + 1) / n)` with this
    /// request, `b` being `load_bound`, or for an exempt candidate `load_bound_cached` (no bound
    /// when that is 0), above the cost of every candidate within its bound (their order among
    /// themselves kept). A candidate is exempt when it holds at least `load_bound_exempt_cached`
    /// of the prompt's `blocks` cached beyond what the candidate holding least has: a prefix
    /// every candidate holds (a system prompt all traffic shares) exempts none. Returns whether
    /// a candidate over its bound was cheaper than every one within (the choice moved
    /// elsewhere). Nothing changes when bounded loads are off, with one candidate, or when the
    /// slices differ in length. A least-loaded candidate is always within its bound: it holds at
    /// most `floor(Σ / n)`, and `ceil(b·(Σ + 1) / n) ≥ floor(Σ / n) + 1` for any `b ≥ 1`.
    pub fn bound_loads(&self, costs: &mut [f64], inputs: &[BoundInput], blocks: u64) -> bool {
        let n = costs.len();
        if !self.bounds_loads() || n < 2 || inputs.len() != n {
            return false;
        }
        let total: u64 = inputs.iter().map(|b| u64::from(b.requests)).sum();
        let least_cached = inputs.iter().map(|b| b.cached).min().unwrap_or(0);
        let exempting = self.load_bound_exempt_cached * blocks as f64;
        let exempt = |i: usize| blocks > 0 && (inputs[i].cached - least_cached) as f64 >= exempting;
        let cap = |b: f64| (b * (total + 1) as f64 / n as f64).ceil();
        let plain = cap(self.load_bound);
        let cached = if self.load_bound_cached > 0.0 {
            cap(self.load_bound_cached.max(self.load_bound))
        } else {
            f64::INFINITY
        };
        let over = |i: usize| {
            let bound = if exempt(i) { cached } else { plain };
            f64::from(inputs[i].requests) + 1.0 > bound
        };
        pass_over(costs, over)
    }

    /// Whether picks count running requests' prompts as cached ([`Self::speculative`], under a
    /// predicted cost).
    pub fn speculates(&self) -> bool {
        self.speculative && self.cost_model.predicts()
    }

    /// The cached prefix, in blocks, weighted by tier.
    pub fn overlap_credit(&self, o: Overlap) -> f64 {
        if o.host <= o.device && o.disk <= o.device {
            // Device blocks only (no host or disk tier beyond them): the other terms are 0.
            return self.overlap_score_credit * float(o.device);
        }
        let host_only = o.host.saturating_sub(o.device);
        let disk_only = o.disk.saturating_sub(o.host.max(o.device));
        self.overlap_score_credit * float(o.device)
            + self.host_cache_hit_weight * float(host_only)
            + self.disk_cache_hit_weight * float(disk_only)
    }

    /// The most [`Self::overlap_credit`] gives for `blocks` cached blocks in any tiers.
    pub fn overlap_credit_bound(&self, blocks: u64) -> f64 {
        let most = self
            .overlap_score_credit
            .max(self.host_cache_hit_weight)
            .max(self.disk_cache_hit_weight)
            .max(0.0);
        most * float(blocks)
    }

    /// A magnitude below which [`Self::cost`], the slot tracker's load keys and the bounds an
    /// ordered pick sums from them are exact in floating point (0.0: not so for these weights),
    /// so equal sums of their terms are equal floats whatever the order they were added in.
    ///
    /// It holds when every weight is a multiple of 2⁻¹⁰ from 0 to 1024 and the block size a
    /// power of two up to 2¹⁶: every term and product is then a multiple of 2⁻²⁰ ÷ block size,
    /// which is exact while below 2⁵³ of that unit; an eighth of that is returned, room for a
    /// few terms below it summed. Dynamo's default weights (1, 0.75, 0.25, 1, 0) qualify.
    pub fn exact_below(&self, block_size: u32) -> f64 {
        let dyadic = |w: f64| (0.0..=1024.0).contains(&w) && (w * 1024.0).fract() == 0.0;
        let weights = [
            self.overlap_score_credit,
            self.host_cache_hit_weight,
            self.disk_cache_hit_weight,
            self.prefill_load_scale,
            self.decode_active_request_weight,
        ];
        if !block_size.is_power_of_two() || block_size > 1 << 16 || !weights.into_iter().all(dyadic)
        {
            return 0.0;
        }
        f64::from(1u32 << 30) / f64::from(block_size)
    }

    pub fn cost(&self, block_size: u32, c: &CandidateLoad) -> f64 {
        // A product with the reciprocal (hoisted out of a loop over candidates; exact for the
        // power-of-two block sizes engines use).
        let prefill_blocks =
            float(c.potential_prefill_tokens) * (1.0 / f64::from(block_size.max(1)));
        let adjusted = (prefill_blocks - self.overlap_credit(c.overlap)).max(0.0);
        self.prefill_load_scale * adjusted
            + float(c.potential_decode_blocks)
            + self.decode_active_request_weight * f64::from(c.active_requests)
    }

    /// Prompt tokens the rank still has to prefill given its cache: what a pick books.
    pub fn effective_prefill_tokens(&self, isl_tokens: u64, block_size: u32, o: Overlap) -> u64 {
        let cached = (self.overlap_credit(o) * f64::from(block_size)).round();
        let cached = if cached.is_finite() && cached > 0.0 {
            cached as u64
        } else {
            0
        };
        isl_tokens - isl_tokens.min(cached)
    }

    /// Index of the chosen candidate: at temperature 0 the cheapest, ties going to the lowest
    /// `tiebreak` (e.g. requests in flight), then to the lowest `booked_at` (the candidate booked
    /// least recently) and then at random; above 0, [`Self::choose`]'s softmax. `costs` must not
    /// be empty.
    pub fn choose_with_tiebreak(
        &self,
        costs: &[f64],
        tiebreak: impl Fn(usize) -> u32,
        booked_at: impl Fn(usize) -> i64,
        rng: &mut fastrand::Rng,
    ) -> usize {
        self.cheapest(costs, tiebreak, booked_at, rng).0
    }

    /// The chosen candidate ([`Self::choose_with_tiebreak`]) and the runner-up: the cheapest of
    /// the others in the total order of `f64`, ties going to the lowest `tiebreak`, then to the
    /// lowest index (None: one candidate; `booked_at` decides only the chosen one). `costs` must
    /// not be empty.
    ///
    /// At temperature 0 it reads `costs` three times (the lowest cost, the ties at it, the
    /// runner-up) with plain float comparisons, and calls `tiebreak` only for candidates tied at
    /// the lowest cost or at the runner-up's, so it stays a few nanoseconds a candidate when
    /// `tiebreak` reads memory elsewhere; costs with NaN or -0.0 (where float comparisons and the
    /// total order part) take the exact, slower runner-up pass.
    pub fn choose_two(
        &self,
        costs: &[f64],
        tiebreak: impl Fn(usize) -> u32,
        booked_at: impl Fn(usize) -> i64,
        rng: &mut fastrand::Rng,
    ) -> (usize, Option<usize>) {
        if costs.is_empty() {
            return (0, None);
        }
        let (best, exact_only) = self.cheapest(costs, &tiebreak, booked_at, rng);
        if exact_only {
            return (best, runner_up(costs, best, &tiebreak));
        }
        // Without NaN, float order is the total order but for -0.0 against 0.0: one pass over
        // the others (before `best`, then after it), `tiebreak` read only where a cost equals the
        // runner-up's so far; a runner-up at zero is redone exactly.
        let mut second = Runner::default();
        second.scan(costs, 0..best, &tiebreak);
        second.scan(costs, best + 1..costs.len(), &tiebreak);
        match second.at {
            Some(i) if costs[i] == 0.0 => (best, runner_up(costs, best, &tiebreak)),
            at => (best, at),
        }
    }

    /// [`Self::choose_with_tiebreak`]'s choice, and whether only the exact (total order)
    /// runner-up pass may follow it: above temperature 0, or when some cost is NaN.
    fn cheapest(
        &self,
        costs: &[f64],
        tiebreak: impl Fn(usize) -> u32,
        booked_at: impl Fn(usize) -> i64,
        rng: &mut fastrand::Rng,
    ) -> (usize, bool) {
        if self.temperature > 0.0 {
            return (self.choose(costs, || rng.f64()), true);
        }
        // The lowest cost as `<=` sees it (NaN never ties), and whether any cost is NaN.
        let mut min = f64::INFINITY;
        let mut nan = false;
        for &c in costs {
            if c < min {
                min = c;
            }
            nan |= c.is_nan();
        }
        // The least (tiebreak, booked_at) among the cheapest, one candidate holding it, and how
        // many do.
        let mut least = (u32::MAX, i64::MAX);
        let (mut first, mut n) = (0usize, 0usize);
        for (i, &c) in costs.iter().enumerate() {
            if c <= min {
                let t = (tiebreak(i), booked_at(i));
                if t < least {
                    (least, first, n) = (t, i, 1);
                } else if t == least {
                    n += 1;
                }
            }
        }
        let k = rng.usize(..n.max(1));
        // Loads may move between the two passes (other picks book meanwhile): then the holder
        // the first pass found stands.
        let best = costs
            .iter()
            .enumerate()
            .filter(|&(i, &c)| c <= min && (tiebreak(i), booked_at(i)) == least)
            .nth(k)
            .map_or(first, |(i, _)| i);
        (best, nan)
    }

    /// Index of the chosen candidate (`costs` must not be empty). `roll` returns uniform numbers in
    /// [0, 1) (for a fixed seed in tests).
    pub fn choose(&self, costs: &[f64], mut roll: impl FnMut() -> f64) -> usize {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if self.temperature <= 0.0 || max <= min {
            // Cheapest, ties broken uniformly: pick the k-th tied index without collecting them.
            let ties = costs.iter().filter(|c| **c <= min).count();
            let k = ((roll() * ties as f64) as usize).min(ties.saturating_sub(1));
            return (0..costs.len())
                .filter(|&i| costs[i] <= min)
                .nth(k)
                .unwrap_or(0);
        }
        // Softmax over -normalised cost; the cheapest has weight 1, the dearest exp(-1/T).
        let weights: Vec<f64> = costs
            .iter()
            .map(|c| (-(c - min) / (max - min) / self.temperature).exp())
            .collect();
        let mut point = roll() * weights.iter().sum::<f64>();
        for (i, w) in weights.iter().enumerate() {
            if point < *w {
                return i;
            }
            point -= w;
        }
        costs.len() - 1
    }
}

/// Raises the cost of every candidate `over` marks above the cost of every other one (their order
/// among themselves kept), so the choice falls on one it does not mark while there is one.
/// Returns whether a marked candidate was cheaper than every unmarked one (the choice moved).
/// Nothing changes when every candidate, or none, is marked.
pub fn pass_over(costs: &mut [f64], over: impl Fn(usize) -> bool) -> bool {
    let (mut within_min, mut within_max, mut over_min) =
        (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY);
    for (i, &c) in costs.iter().enumerate() {
        if over(i) {
            over_min = over_min.min(c);
        } else {
            within_min = within_min.min(c);
            within_max = within_max.max(c);
        }
    }
    if over_min == f64::INFINITY || within_max == f64::NEG_INFINITY {
        return false;
    }
    let shift = within_max - over_min + 1.0;
    if shift > 0.0 {
        for (i, c) in costs.iter_mut().enumerate() {
            if over(i) {
                *c += shift;
            }
        }
    }
    over_min < within_min
}

/// A block or token count as `f64`: through `i64`, one instruction on x86-64 without AVX-512
/// (where `u64` takes several); counts beyond `i64::MAX` (none real) read as `i64::MAX`.
#[inline]
fn float(x: u64) -> f64 {
    x.min(i64::MAX as u64) as i64 as f64
}

/// The runner-up so far in [`CostWeights::choose_two`]'s pass: its index, cost and (once read)
/// tiebreak.
struct Runner {
    at: Option<usize>,
    cost: f64,
    tiebreak: Option<u32>,
}

impl Default for Runner {
    fn default() -> Self {
        Runner {
            at: None,
            cost: f64::INFINITY,
            tiebreak: None,
        }
    }
}

impl Runner {
    /// Takes the cheapest of `costs[range]` (no NaN) against the one so far: lower cost, then
    /// lower tiebreak, then the earlier index.
    fn scan(
        &mut self,
        costs: &[f64],
        range: std::ops::Range<usize>,
        tiebreak: impl Fn(usize) -> u32,
    ) {
        let start = range.start;
        for (k, &c) in costs[range].iter().enumerate() {
            let i = start + k;
            if c < self.cost {
                *self = Runner {
                    at: Some(i),
                    cost: c,
                    tiebreak: None,
                };
            } else if c == self.cost {
                let Some(j) = self.at else {
                    // The first of the others at +inf.
                    self.at = Some(i);
                    continue;
                };
                let held = *self.tiebreak.get_or_insert_with(|| tiebreak(j));
                let t = tiebreak(i);
                if t < held {
                    *self = Runner {
                        at: Some(i),
                        cost: c,
                        tiebreak: Some(t),
                    };
                }
            }
        }
    }
}

/// The cheapest of `costs` other than `best` in the total order, ties to the lowest
/// `tiebreak`, then to the lowest index.
fn runner_up(costs: &[f64], best: usize, tiebreak: impl Fn(usize) -> u32) -> Option<usize> {
    (0..costs.len()).filter(|&i| i != best).min_by(|&a, &b| {
        costs[a]
            .total_cmp(&costs[b])
            .then_with(|| tiebreak(a).cmp(&tiebreak(b)))
    })
}

#[cfg(test)]
mod tests;
