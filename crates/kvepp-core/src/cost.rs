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
//! Temperature 0 picks the cheapest (ties at random); above 0 it samples a softmax over the
//! normalised negative costs. What a pick books as prefill is `effective_prefill_tokens`.
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
    /// Under the `predicted_ttft` cost model: what the chosen endpoint's prediction read (its
    /// booking learns from the observed first token).
    pub ttft: Option<crate::predict::TtftFeatures>,
    /// Under the `predicted_ttft` cost model, for a request with a TTFT budget: what the TTFT
    /// objective's filter reads.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CostModel {
    /// Dynamo's formula over blocks (this module's), as the selection service computes it.
    Dynamo,
    /// Predicted time to first token in ms, learned online per endpoint
    /// ([`crate::predict`]): queueing, the uncached prefill, decode interference and traffic
    /// the engine reports beyond ours. The EPP's default: on every generated trace and workload
    /// of the routing report it reached more of the cache ceiling than Dynamo's cost at equal
    /// or lower TTFT.
    #[default]
    PredictedTtft,
}

/// The knobs, with Dynamo's names and defaults (in the config file: the `DYN_ROUTER_*` names in
/// lower case without the prefix, every field optional, unknown fields rejected; the variables
/// themselves are applied by kvepp's configuration loading).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
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
    /// kvepp's own: the EPP's picks by Dynamo's cost (default) or by predicted TTFT. The HTTP
    /// selection service always uses Dynamo's.
    pub cost_model: CostModel,
    /// kvepp's own: bounded loads for the EPP's picks (0 turns it off; otherwise ≥ 1). A
    /// candidate whose requests (active there, plus those its engine reports beyond them) would
    /// exceed `load_bound` × the mean over the candidates, this request included and rounded up,
    /// is passed over while another is within the bound ([`Self::bound_loads`]). The HTTP
    /// selection service, Dynamo's contract, does not apply it.
    pub load_bound: f64,
    /// kvepp's own: the share of the prompt's blocks (0-1) an endpoint must hold cached, beyond
    /// what the candidate holding least has, to be exempt from `load_bound` (such a hit saves at
    /// least that share of the prefill, more than an extra request in the queue costs on any
    /// workload we measured; a prefix every candidate holds saves nothing by going to one of
    /// them); above 1 none is.
    pub load_bound_exempt_cached: f64,
    /// kvepp's own: the bound for candidates exempt by `load_bound_exempt_cached`, as a multiple
    /// of the same mean (0, the default: they are unbounded; otherwise ≥ `load_bound` and ≥ 1).
    pub load_bound_cached: f64,
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
    /// values, kvepp's cost model (predicted TTFT) and bounded loads on.
    fn default() -> Self {
        CostWeights {
            cost_model: CostModel::PredictedTtft,
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
    /// `tiebreak` (e.g. requests in flight) and then at random; above 0, [`Self::choose`]'s
    /// softmax. `costs` must not be empty.
    pub fn choose_with_tiebreak(
        &self,
        costs: &[f64],
        tiebreak: impl Fn(usize) -> u32,
        rng: &mut fastrand::Rng,
    ) -> usize {
        self.cheapest(costs, tiebreak, rng).0
    }

    /// The chosen candidate ([`Self::choose_with_tiebreak`]) and the runner-up: the cheapest of
    /// the others in the total order of `f64`, ties going to the lowest `tiebreak`, then to the
    /// lowest index (None: one candidate). `costs` must not be empty.
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
        rng: &mut fastrand::Rng,
    ) -> (usize, Option<usize>) {
        if costs.is_empty() {
            return (0, None);
        }
        let (best, exact_only) = self.cheapest(costs, &tiebreak, rng);
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
        let mut least = u32::MAX;
        let mut n = 0usize;
        for (i, &c) in costs.iter().enumerate() {
            if c <= min {
                let t = tiebreak(i);
                if t < least {
                    least = t;
                    n = 1;
                } else if t == least {
                    n += 1;
                }
            }
        }
        let k = rng.usize(..n.max(1));
        let best = costs
            .iter()
            .enumerate()
            .filter(|&(i, &c)| c <= min && tiebreak(i) == least)
            .nth(k)
            .map_or(0, |(i, _)| i);
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
mod tests {
    use super::*;

    fn load(
        device: u64,
        host: u64,
        disk: u64,
        prefill: u64,
        decode: u64,
        active: u32,
    ) -> CandidateLoad {
        CandidateLoad {
            overlap: Overlap { device, host, disk },
            potential_prefill_tokens: prefill,
            potential_decode_blocks: decode,
            active_requests: active,
        }
    }

    #[test]
    fn formula_by_hand() {
        let w = CostWeights::dynamo();
        // 512 prompt tokens + 64 active prefill, block 16: 36 blocks; 10 on GPU, 4 more on host, 2 more on disk.
        let c = load(10, 14, 16, 576, 40, 3);
        let credit = 10.0 + 0.75 * 4.0 + 0.25 * 2.0;
        assert_eq!(w.overlap_credit(c.overlap), credit);
        assert_eq!(w.cost(16, &c), (36.0 - credit) + 40.0);
        let w2 = CostWeights {
            prefill_load_scale: 2.0,
            decode_active_request_weight: 1.5,
            ..w
        };
        assert_eq!(w2.cost(16, &c), 2.0 * (36.0 - credit) + 40.0 + 4.5);
        // More credit than prefill: clamped at zero, only decode load remains.
        assert_eq!(w.cost(16, &load(100, 100, 100, 32, 7, 0)), 7.0);
        // effective = isl - round(credit * block_size)
        assert_eq!(
            w.effective_prefill_tokens(512, 16, c.overlap),
            512 - (credit * 16.0) as u64
        );
        assert_eq!(
            w.effective_prefill_tokens(
                100,
                16,
                Overlap {
                    device: 50,
                    host: 50,
                    disk: 50
                }
            ),
            0
        );
    }

    #[test]
    fn choose_cheapest_with_random_ties() {
        let w = CostWeights::dynamo();
        let mut rng = fastrand::Rng::with_seed(3);
        let mut seen = [0; 4];
        for _ in 0..4000 {
            seen[w.choose(&[5.0, 2.0, 2.0, 9.0], || rng.f64())] += 1;
        }
        assert_eq!((seen[0], seen[3]), (0, 0));
        assert!(seen[1] > 1700 && seen[2] > 1700, "{seen:?}");
    }

    #[test]
    fn temperature_samples_a_softmax() {
        let w = CostWeights {
            temperature: 0.5,
            ..CostWeights::dynamo()
        };
        let mut rng = fastrand::Rng::with_seed(11);
        let mut seen = [0u32; 3];
        let n = 30_000;
        for _ in 0..n {
            seen[w.choose(&[0.0, 5.0, 10.0], || rng.f64())] += 1;
        }
        // Normalised costs 0, 0.5, 1 → weights 1, e^-1, e^-2.
        let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
        for (i, want) in [1.0 / z, (-1.0f64).exp() / z, (-2.0f64).exp() / z]
            .iter()
            .enumerate()
        {
            let got = f64::from(seen[i]) / f64::from(n);
            assert!((got - want).abs() < 0.02, "candidate {i}: {got} vs {want}");
        }
        // Equal costs: uniform, whatever the temperature.
        let mut rng = fastrand::Rng::with_seed(5);
        let mut eq = [0; 2];
        for _ in 0..2000 {
            eq[w.choose(&[4.0, 4.0], || rng.f64())] += 1;
        }
        assert!(eq[0] > 800 && eq[1] > 800, "{eq:?}");
    }

    /// The simple choice this module made before [`CostWeights::choose_two`]: four passes for
    /// the chosen one, a `min_by` over the others for the runner-up.
    fn reference_two(
        w: &CostWeights,
        costs: &[f64],
        tiebreak: impl Fn(usize) -> u32,
        rng: &mut fastrand::Rng,
    ) -> (usize, Option<usize>) {
        let best = if w.temperature > 0.0 {
            w.choose(costs, || rng.f64())
        } else {
            let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let least = (0..costs.len())
                .filter(|&i| costs[i] <= min)
                .map(&tiebreak)
                .min()
                .unwrap_or(0);
            let tied = |i: &usize| costs[*i] <= min && tiebreak(*i) == least;
            let n = (0..costs.len()).filter(tied).count();
            (0..costs.len())
                .filter(tied)
                .nth(rng.usize(..n.max(1)))
                .unwrap_or(0)
        };
        (best, runner_up(costs, best, &tiebreak))
    }

    #[test]
    fn choose_two_agrees_with_the_simple_choice() {
        // Not a caller's case (candidates are never empty), but no panic either.
        let w = CostWeights::dynamo();
        assert_eq!(
            w.choose_two(&[], |_| 0, &mut fastrand::Rng::with_seed(1)),
            (0, None)
        );
        let mut gen = fastrand::Rng::with_seed(17);
        let odd = [f64::NAN, f64::INFINITY, -0.0, 0.0, -1.0, f64::NEG_INFINITY];
        for round in 0..20_000 {
            let n = gen.usize(1..12);
            let costs: Vec<f64> = (0..n)
                .map(|_| match gen.u8(..10) {
                    0 => odd[gen.usize(..odd.len())],
                    _ => f64::from(gen.u8(..4)) * 0.5,
                })
                .collect();
            let ties: Vec<u32> = (0..n).map(|_| gen.u32(..3)).collect();
            let w = CostWeights {
                temperature: if round % 7 == 0 { 0.3 } else { 0.0 },
                ..CostWeights::dynamo()
            };
            let (mut a, mut b) = (
                fastrand::Rng::with_seed(round),
                fastrand::Rng::with_seed(round),
            );
            let got = w.choose_two(&costs, |i| ties[i], &mut a);
            let want = reference_two(&w, &costs, |i| ties[i], &mut b);
            assert_eq!(got, want, "costs {costs:?}, ties {ties:?}");
            // Same draws: the pick after this one sees the same random numbers.
            assert_eq!(a.u64(..), b.u64(..));
        }
    }

    /// Bounded loads against the plain definition: the cheapest candidate among those holding at
    /// most `ceil(b·(Σ + 1) / n)` requests with this one, `b` the plain bound or for exempt ones
    /// the cached bound (none when 0), on random costs and loads.
    #[test]
    fn bounded_loads_choose_the_cheapest_within_the_bound() {
        let mut gen = fastrand::Rng::with_seed(5);
        let mut moved = 0;
        for round in 0..20_000 {
            let n = gen.usize(1..10);
            let mut costs: Vec<f64> = (0..n).map(|_| f64::from(gen.u16(..500))).collect();
            let requests: Vec<u32> = (0..n).map(|_| gen.u32(..8)).collect();
            // A prompt of 10 blocks; every candidate holds `floor` of them, some hold more.
            let (blocks, floor) = (10u64, gen.u64(..=3));
            let inputs: Vec<BoundInput> = requests
                .iter()
                .map(|&requests| BoundInput {
                    requests,
                    cached: floor + gen.u64(..=7),
                })
                .collect();
            let exempt_share = [0.0, 0.25, 0.5, 1.0, 1.5][(round / 15) % 5];
            let bound = [1.0, 1.1, 1.25, 1.5, 3.0][round % 5];
            let cached = [0.0, bound, 1.5 * bound][(round / 5) % 3];
            let w = CostWeights {
                load_bound: bound,
                load_bound_cached: cached,
                load_bound_exempt_cached: exempt_share,
                ..CostWeights::dynamo()
            };
            assert!(w.validate().is_empty());
            let total: u32 = requests.iter().sum();
            let cap = |b: f64| (b * f64::from(total + 1) / n as f64).ceil();
            // Exempt: at least the share of the prompt cached beyond the least any candidate
            // holds (with one candidate there is nothing to bound).
            let least = inputs.iter().map(|b| b.cached).min().unwrap_or(0);
            let exempt = |i: usize| (inputs[i].cached - least) as f64 >= exempt_share * 10.0;
            let within_bound = |i: usize| match (exempt(i), cached) {
                (true, 0.0) => true,
                (true, c) => f64::from(requests[i] + 1) <= cap(c),
                (false, _) => f64::from(requests[i] + 1) <= cap(bound),
            };
            let within: Vec<usize> = (0..n).filter(|&i| within_bound(i)).collect();
            assert!(
                !within.is_empty(),
                "a least-loaded candidate is always within"
            );
            let best_within = within
                .iter()
                .map(|&i| costs[i])
                .fold(f64::INFINITY, f64::min);
            let cheapest = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let original = costs.clone();
            let passed_over = w.bound_loads(&mut costs, &inputs, blocks);
            assert_eq!(
                passed_over,
                cheapest < best_within,
                "{original:?} {requests:?}"
            );
            moved += usize::from(passed_over);
            let mut rng = fastrand::Rng::with_seed(round as u64);
            let chosen = w.choose_with_tiebreak(&costs, |_| 0, &mut rng);
            assert!(
                within.contains(&chosen),
                "{original:?} {requests:?} → {chosen}"
            );
            assert_eq!(original[chosen], best_within);
            // Within the bound nothing changed, and over it the order is kept.
            for i in 0..n {
                if within.contains(&i) {
                    assert_eq!(costs[i], original[i]);
                }
                for j in 0..n {
                    if original[i] < original[j] && !within.contains(&i) && !within.contains(&j) {
                        assert!(costs[i] < costs[j]);
                    }
                }
            }
        }
        assert!(moved > 1000, "the bound moved {moved} choices");
        // Off, or one candidate: untouched.
        let mut costs = vec![1.0, 5.0];
        let inputs = [9, 0].map(|requests| BoundInput {
            requests,
            cached: 0,
        });
        assert!(!CostWeights::dynamo().bound_loads(&mut costs, &inputs, 10));
        assert_eq!(costs, [1.0, 5.0]);
    }

    #[test]
    fn load_bound_is_zero_or_at_least_one() {
        for (bound, ok) in [
            (0.0, true),
            (1.0, true),
            (1.3, true),
            (0.5, false),
            (f64::NAN, false),
            (f64::INFINITY, false),
        ] {
            let w = CostWeights {
                load_bound: bound,
                ..CostWeights::dynamo()
            };
            assert_eq!(w.validate().is_empty(), ok, "{bound}");
        }
        // The cached bound: 0 (none) or at least 1 and at least the plain bound.
        for (bound, cached, ok) in [
            (1.0, 0.0, true),
            (1.0, 1.0, true),
            (1.25, 1.5, true),
            (0.0, 1.5, true),
            (1.5, 1.25, false),
            (0.0, 0.5, false),
            (1.0, f64::NAN, false),
            (1.0, -1.0, false),
        ] {
            let w = CostWeights {
                load_bound: bound,
                load_bound_cached: cached,
                ..CostWeights::dynamo()
            };
            let errors = w.validate();
            assert_eq!(errors.is_empty(), ok, "{bound} {cached}: {errors:?}");
            assert!(
                errors.iter().all(|e| e.name == "load_bound_cached"),
                "{errors:?}"
            );
        }
    }
}
