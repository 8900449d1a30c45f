//! Time to first token predicted per endpoint, learned online: the KV-aware picker's
//! `predicted_ttft` cost model.
//!
//! A request's TTFT on an endpoint is modelled as linear in what that endpoint has to do before
//! the request's first token:
//!
//! `ttft_ms = θ0 + θ1 · prefill_ktokens + θ2 · decode_ktokens + θ3 · hidden_requests`
//!
//! - `prefill_ktokens`: thousands of prompt tokens to compute first: the prefill booked there and
//!   not yet done (the queue) plus this prompt's uncached part;
//! - `decode_ktokens`: thousands of tokens of KV the endpoint's decoding requests read every step
//!   (what slows each step that carries the prefill);
//! - `hidden_requests`: requests the engine reports (running + waiting, from its metrics) beyond
//!   those kvepp knows of there (routed here, or booked by a peer replica and shared by replica
//!   sync): another client's traffic, which only the engine's own metrics show.
//!
//! θ is the pool's ([`TtftModel`]): it starts from an 8B model on one H100 (≈25k prefill
//! tokens/s) and is refit by recursive least squares with forgetting each time a streamed
//! response's first chunk arrives (the observed TTFT of a request whose features were recorded at
//! its pick); every endpoint also has a speed factor ([`EndpointSpeed`]) its predictions are
//! multiplied by, learned from the same observations, so a slower engine is known as slower
//! without splitting the data the shared fit needs. A factor is the endpoint's speed relative to
//! the pool's: what every endpoint shares of the model's error (while the fit is still catching up
//! with engines slower than its prior, all of them) is the pool's ratio, a running mean of the
//! log-ratio of observed to predicted over all observations that every prediction is also
//! multiplied by. Without it each observation of a pool slower than the model raised the observed
//! endpoint's factor, so the endpoint observed most (the one holding a cache everyone reuses)
//! looked slowest and lost its own prefixes to cold engines. A factor decays back toward 1 while its
//! endpoint gives no observations (an endpoint avoided because it once looked slow would
//! otherwise never be tried again, its neighbours taking all its traffic: herding), so it holds
//! only while traffic keeps confirming it. Invariants: coefficients stay ≥ 0 and ≤ 20× their
//! prior (projected after each update: predictions are never negative and never fall with more
//! work, and TTFTs of a saturated engine, mostly queueing the features do not see, cannot blow
//! the fit up until decode load outweighs the cache; an engine slower than that is its factor's
//! to learn); an observation's residual is clipped, so one request stuck behind an engine
//! restart does not swing the model; the covariance is bounded (no wind-up along features that stay at 0); speed
//! factors stay within 0.1-10.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Instant;

use crate::types::clock_nanos;

/// What the model reads for one request on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftFeatures {
    /// Of `prefill_ktokens`, this prompt's own uncached part (what it adds to the cache, evicting
    /// as much where the cache is full).
    pub uncached_ktokens: f64,
    pub prefill_ktokens: f64,
    pub decode_ktokens: f64,
    pub hidden_requests: f64,
}

/// What the TTFT objective reads of a pick: the chosen endpoint's predicted TTFT, and the least
/// any candidate would take idle (with only the prompt's own uncached prefill): a budget below
/// that cannot be met by waiting.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftOutlook {
    pub predicted_ms: f64,
    pub floor_ms: f64,
    /// The chosen endpoint's predicted time per output token (what a TPOT objective is compared
    /// with), and the same on an idle endpoint (the batch this request alone): None where no
    /// decode was predicted.
    pub itl_ms: Option<f64>,
    pub itl_floor_ms: Option<f64>,
}

impl TtftFeatures {
    fn vector(&self) -> [f64; N] {
        [
            1.0,
            self.prefill_ktokens,
            self.decode_ktokens,
            self.hidden_requests,
        ]
    }
}

const N: usize = 4;

/// The starting coefficients: ms, ms per 1k prompt tokens, ms per 1k decoding tokens, ms per
/// hidden request.
pub const PRIOR: [f64; N] = [5.0, 40.0, 0.1, 30.0];
/// Prior variances of the coefficients (how far the data may move them quickly).
const PRIOR_VARIANCE: [f64; N] = [100.0, 400.0, 4.0, 400.0];
/// Forgetting factor: observations weigh `0.99^age` (a memory of about 100 first tokens).
const FORGET: f64 = 0.99;
/// The covariance's trace is kept below this multiple of the prior's.
const MAX_TRACE_FACTOR: f64 = 10.0;
/// Weight of the newest observation in the pool's ratio (a running mean, bias-corrected so the
/// first observations count in full).
const POOL_RATE: f64 = 0.1;
/// Each coefficient stays below this multiple of its prior. Under saturation, TTFTs are mostly
/// queueing the features do not see, and an unbounded fit blew up (×2,400 the prior per prefill
/// token, ×130,000 per decoding token, seen in the simulator), weighing decode load far above the
/// cache and herding.
const MAX_PRIOR_FACTOR: f64 = 20.0;

/// Recursive least squares with forgetting over `N` features, projected onto
/// `0 ≤ θ ≤ MAX_PRIOR_FACTOR × prior` after each update, with the residual clipped and the
/// covariance's trace bounded (see the module's invariants). Shared by the TTFT model and the
/// inter-token latency model ([`crate::decode`]).
#[derive(Debug, Clone)]
pub(crate) struct Rls<const N: usize> {
    pub(crate) theta: [f64; N],
    p: [[f64; N]; N],
    prior: [f64; N],
    variance: [f64; N],
    pub(crate) observed: u64,
}

impl Default for Rls<N> {
    fn default() -> Self {
        Rls::new(PRIOR, PRIOR_VARIANCE)
    }
}

impl<const N: usize> Rls<N> {
    /// Starts at `prior`, each coefficient free to move about as far as its `variance` says.
    pub(crate) fn new(prior: [f64; N], variance: [f64; N]) -> Self {
        let mut p = [[0.0; N]; N];
        for (i, v) in variance.iter().enumerate() {
            p[i][i] = *v;
        }
        Rls {
            theta: prior,
            p,
            prior,
            variance,
            observed: 0,
        }
    }

    pub(crate) fn update(&mut self, x: &[f64; N], y: f64) {
        let predicted = predict_with(&self.theta, x);
        // Clip the residual: an observation 5× (+ 50 ms) off the prediction counts as that much.
        let limit = 5.0 * predicted + 50.0;
        let residual = (y - predicted).clamp(-limit, limit);
        let px: [f64; N] = std::array::from_fn(|i| (0..N).map(|j| self.p[i][j] * x[j]).sum());
        let denom = FORGET + (0..N).map(|i| x[i] * px[i]).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let k: [f64; N] = std::array::from_fn(|i| px[i] / denom);
        // Projected onto θ ≥ 0: time never decreases with work (and intercept and load terms,
        // nearly collinear, cannot trade places through negative values).
        for ((t, ki), prior) in self.theta.iter_mut().zip(k).zip(self.prior) {
            *t = (*t + ki * residual).clamp(0.0, MAX_PRIOR_FACTOR * prior);
        }
        for (row, ki) in self.p.iter_mut().zip(k) {
            for (v, pxj) in row.iter_mut().zip(px) {
                *v = (*v - ki * pxj) / FORGET;
            }
        }
        let trace: f64 = (0..N).map(|i| self.p[i][i]).sum();
        let cap = MAX_TRACE_FACTOR * self.variance.iter().sum::<f64>();
        if trace > cap {
            let s = cap / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= s);
        }
        if self.theta.iter().any(|t| !t.is_finite()) {
            *self = Rls::new(self.prior, self.variance);
        }
        self.observed += 1;
    }
}

pub(crate) fn predict_with<const N: usize>(theta: &[f64; N], x: &[f64; N]) -> f64 {
    theta
        .iter()
        .zip(x)
        .map(|(t, v)| t.max(0.0) * v)
        .sum::<f64>()
        .max(0.0)
}

/// The pool's TTFT model (one per KV-aware picker): the coefficients every endpoint shares (the
/// pool's average endpoint), read without locks on every pick, refit under a lock on every
/// observed first token.
#[derive(Debug)]
pub struct TtftModel {
    /// The coefficients in use (f64 bits, each ≥ 0).
    published: [AtomicU64; N],
    /// The pool's ratio in use (f64 bits; kept as the ratio, not its log, so a pick reads it
    /// without an `exp` per candidate).
    pool_ratio: AtomicU64,
    fit: Mutex<Fit>,
}

/// What refitting keeps under the lock: the regression, and the pool's ratio as an exponentially
/// weighted mean of log-ratios (`sum` and `weight` decay alike; the mean is their quotient).
#[derive(Debug, Clone, Default)]
struct Fit {
    rls: Rls<N>,
    ratio_sum: f64,
    ratio_weight: f64,
}

impl Default for TtftModel {
    fn default() -> Self {
        TtftModel {
            published: PRIOR.map(|v| AtomicU64::new(v.to_bits())),
            pool_ratio: AtomicU64::new(1.0f64.to_bits()),
            fit: Mutex::new(Fit::default()),
        }
    }
}

/// How far one observation moves an endpoint's speed factor (in log space, the log-ratio
/// clipped to ±1 first).
const SPEED_RATE: f64 = 0.2;
const SPEED_RANGE: (f64, f64) = (0.1, 10.0);
/// Seconds without observations after which a factor's logarithm has halved (it goes on toward
/// 0, i.e. a factor of 1, as `1 / (1 + age / SPEED_HALF_LIFE_S)`: no exponential per candidate).
/// An endpoint observed every second keeps about 80% of the log of its true ratio (3× slower
/// reads as ~2.4×); one avoided for half a minute is back within ~1.4× of the others.
pub const SPEED_HALF_LIFE_S: f64 = 10.0;

/// One endpoint's speed relative to the pool's model: its predictions are the model's times this
/// factor (1 to start; above 1, slower), decaying toward 1 from when it was last learned.
#[derive(Debug)]
pub struct EndpointSpeed {
    /// ln of the factor as last learned (f64 bits).
    log_factor: AtomicU64,
    /// When it was learned ([`clock_nanos`]).
    learned_at: AtomicI64,
    observed: AtomicU64,
}

impl Default for EndpointSpeed {
    fn default() -> Self {
        EndpointSpeed {
            log_factor: AtomicU64::new(0.0f64.to_bits()),
            learned_at: AtomicI64::new(i64::MIN),
            observed: AtomicU64::new(0),
        }
    }
}

impl EndpointSpeed {
    /// The factor as last learned.
    pub fn factor(&self) -> f64 {
        f64::from_bits(self.log_factor.load(Ordering::Relaxed)).exp()
    }

    /// The factor in use at `now`: the learned one, decayed toward 1 for the time since.
    pub fn factor_at(&self, now: Instant) -> f64 {
        self.factor_at_nanos(clock_nanos(now))
    }

    /// [`Self::factor_at`] with `now` converted once per pick.
    pub(crate) fn factor_at_nanos(&self, now: i64) -> f64 {
        let log = f64::from_bits(self.log_factor.load(Ordering::Relaxed));
        if log == 0.0 {
            return 1.0;
        }
        let age_ns = now.saturating_sub(self.learned_at.load(Ordering::Relaxed));
        let age_s = age_ns.max(0) as f64 * 1e-9;
        (log / (1.0 + age_s / SPEED_HALF_LIFE_S)).exp()
    }

    /// First tokens observed on this endpoint.
    pub fn observed(&self) -> u64 {
        self.observed.load(Ordering::Relaxed)
    }
}

impl TtftModel {
    /// The shared coefficients in use.
    pub fn coefficients(&self) -> [f64; N] {
        std::array::from_fn(|i| f64::from_bits(self.published[i].load(Ordering::Relaxed)))
    }

    /// The pool's ratio in use: what every endpoint's prediction is multiplied by besides its
    /// own factor (about 1 once the shared fit has caught up).
    pub fn pool_ratio(&self) -> f64 {
        f64::from_bits(self.pool_ratio.load(Ordering::Relaxed))
    }

    /// Predicted TTFT in ms (≥ 0) on an endpoint of speed `speed` at `now`.
    pub fn predict(&self, speed: &EndpointSpeed, f: &TtftFeatures, now: Instant) -> f64 {
        self.pool_ratio() * speed.factor_at(now) * predict_with(&self.coefficients(), &f.vector())
    }

    /// [`Self::predict`] with `now` converted once per pick.
    pub(crate) fn predict_at(&self, speed: &EndpointSpeed, f: &TtftFeatures, now: i64) -> f64 {
        self.pool_ratio()
            * speed.factor_at_nanos(now)
            * predict_with(&self.coefficients(), &f.vector())
    }

    /// The TTFT objective's view of a pick at `now`: the chosen endpoint's predicted TTFT for
    /// `chosen`, and the least any candidate would take with nothing queued or decoding, only the
    /// prompt's own uncached part (`own`: each candidate's speed and uncached ktokens).
    pub(crate) fn outlook<'a>(
        &self,
        chosen: (&EndpointSpeed, &TtftFeatures),
        own: impl Iterator<Item = (&'a EndpointSpeed, f64)>,
        now: i64,
    ) -> TtftOutlook {
        let theta = self.coefficients();
        let pool = self.pool_ratio();
        let predicted_ms =
            pool * chosen.0.factor_at_nanos(now) * predict_with(&theta, &chosen.1.vector());
        let floor_ms = own
            .map(|(speed, k)| {
                let f = TtftFeatures {
                    uncached_ktokens: k,
                    prefill_ktokens: k,
                    ..TtftFeatures::default()
                };
                pool * speed.factor_at_nanos(now) * predict_with(&theta, &f.vector())
            })
            .fold(f64::INFINITY, f64::min);
        TtftOutlook {
            predicted_ms,
            floor_ms: if floor_ms.is_finite() {
                floor_ms
            } else {
                predicted_ms
            },
            itl_ms: None,
            itl_floor_ms: None,
        }
    }

    /// What a pick at `now` ([`clock_nanos`]) minimises: the predicted TTFT plus the time the
    /// prompt's uncached part will cost others once it has evicted as much of the cache they
    /// would reuse (counted as its own prefill time: a prefix moved to a cold endpoint is paid
    /// for twice).
    pub(crate) fn cost(&self, speed: &EndpointSpeed, f: &TtftFeatures, now: i64) -> f64 {
        let theta = self.coefficients();
        self.pool_ratio()
            * speed.factor_at_nanos(now)
            * (predict_with(&theta, &f.vector()) + theta[1] * f.uncached_ktokens)
    }

    /// What the prompt's own uncached part (`uncached_ktokens`) takes to prefill on an endpoint of
    /// speed `speed` at `now` (ms): how long the streams decoding there stall for it.
    pub(crate) fn prefill_ms(&self, speed: &EndpointSpeed, uncached_ktokens: f64, now: i64) -> f64 {
        let theta1 = f64::from_bits(self.published[1].load(Ordering::Relaxed));
        self.pool_ratio() * speed.factor_at_nanos(now) * theta1 * uncached_ktokens
    }

    /// Refits with one observed TTFT, arrived at `now`, for a request picked with features `f`
    /// on an endpoint of speed `speed`: the shared coefficients learn it as the pool's, the
    /// pool's ratio takes in the ratio of what it took to what the shared model predicts, and the
    /// endpoint's factor (as it stands at `now`) moves toward that ratio relative to the pool's.
    pub fn observe(&self, speed: &EndpointSpeed, f: &TtftFeatures, ttft_ms: f64, now: Instant) {
        if !(ttft_ms.is_finite() && ttft_ms >= 0.0) {
            return;
        }
        let x = f.vector();
        let now = clock_nanos(now);
        let factor = speed.factor_at_nanos(now);
        let mut fit = self.fit.lock();
        // The shared fit learns the pool's average endpoint first; what it still misses of this
        // observation is the pool's ratio and, relative to that, the endpoint's.
        fit.rls.update(&x, ttft_ms);
        for (slot, v) in self.published.iter().zip(fit.rls.theta) {
            slot.store(v.to_bits(), Ordering::Relaxed);
        }
        let base = predict_with(&fit.rls.theta, &x);
        if base > 1.0 && ttft_ms > 0.0 {
            let observed = (ttft_ms / base).clamp(SPEED_RANGE.0, SPEED_RANGE.1).ln();
            fit.ratio_sum = (1.0 - POOL_RATE) * fit.ratio_sum + POOL_RATE * observed;
            fit.ratio_weight = (1.0 - POOL_RATE) * fit.ratio_weight + POOL_RATE;
            let pool = fit.ratio_sum / fit.ratio_weight;
            self.pool_ratio
                .store(pool.exp().to_bits(), Ordering::Relaxed);
            let target = (observed - pool).exp().clamp(SPEED_RANGE.0, SPEED_RANGE.1);
            let r = (target / factor).ln().clamp(-1.0, 1.0);
            let next = (factor * (SPEED_RATE * r).exp()).clamp(SPEED_RANGE.0, SPEED_RANGE.1);
            speed
                .log_factor
                .store(next.ln().to_bits(), Ordering::Relaxed);
            speed.learned_at.store(now, Ordering::Relaxed);
        }
        speed.observed.fetch_add(1, Ordering::Relaxed);
    }

    /// First tokens observed over the pool.
    pub fn observed(&self) -> u64 {
        self.fit.lock().rls.observed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(p: f64, d: f64, h: f64) -> TtftFeatures {
        TtftFeatures {
            uncached_ktokens: 0.0,
            prefill_ktokens: p,
            decode_ktokens: d,
            hidden_requests: h,
        }
    }

    #[test]
    fn learns_an_engine_slower_than_the_prior() {
        let m = TtftModel::default();
        let t0 = Instant::now();
        let e = EndpointSpeed::default();
        let before = m.predict(&e, &features(4.0, 10.0, 0.0), t0);
        assert!((before - (5.0 + 160.0 + 1.0)).abs() < 1e-9, "{before}");
        // The truth: 12 ms + 100 ms per 1k prompt tokens + 2 ms per 1k decoding tokens.
        let truth = |f: &TtftFeatures| 12.0 + 100.0 * f.prefill_ktokens + 2.0 * f.decode_ktokens;
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..400 {
            let f = features(rng.f64() * 8.0, rng.f64() * 40.0, 0.0);
            m.observe(&e, &f, truth(&f), t0);
        }
        let f = features(4.0, 10.0, 0.0);
        let after = m.predict(&e, &f, t0);
        assert!(
            (after - truth(&f)).abs() < 0.05 * truth(&f),
            "{after} vs {}",
            truth(&f)
        );
        assert_eq!((m.observed(), e.observed()), (400, 400));
        // The never-seen feature kept its prior and the covariance stayed bounded.
        assert!((m.coefficients()[3] - PRIOR[3]).abs() < 1.0);
    }

    #[test]
    fn a_slower_endpoint_gets_a_larger_factor_from_the_same_model() {
        let m = TtftModel::default();
        let t0 = Instant::now();
        let (fast, slow) = (EndpointSpeed::default(), EndpointSpeed::default());
        let truth = |f: &TtftFeatures| 10.0 + 40.0 * f.prefill_ktokens;
        let mut rng = fastrand::Rng::with_seed(4);
        for _ in 0..300 {
            let f = features(rng.f64() * 8.0, 0.0, 0.0);
            m.observe(&fast, &f, truth(&f), t0);
            m.observe(&slow, &f, 3.0 * truth(&f), t0);
        }
        let ratio = slow.factor() / fast.factor();
        assert!((ratio - 3.0).abs() < 0.3, "{ratio}");
        let f = features(2.0, 0.0, 0.0);
        let (pf, ps) = (m.predict(&fast, &f, t0), m.predict(&slow, &f, t0));
        assert!(ps > 2.5 * pf, "{ps} vs {pf}");
    }

    /// Two engines alike, both far slower than the prior, one observed three times as often
    /// (it holds the prefixes everyone reuses): neither factor moves away from the other, the
    /// pool's ratio takes the common slowness, and predictions are the truth's from the start.
    #[test]
    fn a_pool_slower_than_the_model_moves_no_endpoints_factor() {
        let m = TtftModel::default();
        let t0 = Instant::now();
        let (busy, quiet) = (EndpointSpeed::default(), EndpointSpeed::default());
        let f = features(0.8, 0.0, 0.0);
        let truth = 300.0;
        for k in 0..40 {
            let e = if k % 4 == 3 { &quiet } else { &busy };
            m.observe(e, &f, truth, t0);
            let ratio = busy.factor() / quiet.factor();
            assert!((0.9..1.1).contains(&ratio), "after {k}: {ratio}");
            let predicted = m.predict(&busy, &f, t0);
            assert!(
                (predicted - truth).abs() < 0.25 * truth,
                "after {k}: {predicted}"
            );
        }
        assert!(m.pool_ratio() > 1.0);
    }

    #[test]
    fn outliers_and_garbage_do_not_break_it() {
        let m = TtftModel::default();
        let t0 = Instant::now();
        let e = EndpointSpeed::default();
        let f = features(1.0, 0.0, 0.0);
        for _ in 0..50 {
            m.observe(&e, &f, 45.0, t0);
        }
        let steady = m.predict(&e, &f, t0);
        m.observe(&e, &f, 60_000.0, t0);
        m.observe(&e, &f, f64::NAN, t0);
        m.observe(&e, &f, -3.0, t0);
        let after = m.predict(&e, &f, t0);
        assert!(after < steady * 8.0, "{steady} → {after}");
        assert!(m.coefficients().iter().all(|c| c.is_finite() && *c >= 0.0));
        // Coefficients stay ≥ 0 whatever the data: predictions never go negative.
        for _ in 0..200 {
            m.observe(&e, &features(5.0, 0.0, 0.0), 0.0, t0);
        }
        assert!(m.coefficients().iter().all(|c| *c >= 0.0));
        assert!(m.predict(&e, &features(0.0, 0.0, 3.0), t0) >= 0.0);
    }

    #[test]
    fn a_factor_decays_toward_one_without_observations_and_relearns_from_there() {
        let m = TtftModel::default();
        let t0 = Instant::now();
        let (slow, fast) = (EndpointSpeed::default(), EndpointSpeed::default());
        let f = features(2.0, 0.0, 0.0);
        let truth = 5.0 + 40.0 * 2.0;
        for _ in 0..100 {
            m.observe(&slow, &f, 3.0 * truth, t0);
            m.observe(&fast, &f, truth / 2.0, t0);
        }
        let learned = slow.factor();
        assert!(learned > 1.5 && (slow.factor_at(t0) - learned).abs() < 1e-12);
        let at = |s: f64| t0 + std::time::Duration::from_secs_f64(s);
        // Half the log after one half-life, a third after two; faster endpoints come back up.
        let half = slow.factor_at(at(SPEED_HALF_LIFE_S));
        assert!((half.ln() - learned.ln() / 2.0).abs() < 1e-9, "{half}");
        assert!(
            (slow.factor_at(at(2.0 * SPEED_HALF_LIFE_S)).ln() - learned.ln() / 3.0).abs() < 1e-9
        );
        assert!(fast.factor() < 0.8 && fast.factor_at(at(600.0)) > 0.95);
        // Times before the last observation read the factor as learned.
        assert_eq!(
            slow.factor_at(t0 - std::time::Duration::from_secs(5)),
            learned
        );
        // An observation after a while moves the decayed factor, not the stale one.
        m.observe(&slow, &f, truth, at(100.0));
        assert!(slow.factor() < half, "{}", slow.factor());
        assert_eq!(slow.observed(), 101);
    }

    #[test]
    fn saturation_cannot_blow_the_coefficients_up() {
        // TTFTs of a saturated engine: seconds of queueing the features barely see, growing with
        // the decoding KV that piles up meanwhile.
        let m = TtftModel::default();
        let e = EndpointSpeed::default();
        let t0 = Instant::now();
        let mut rng = fastrand::Rng::with_seed(9);
        for _ in 0..2_000 {
            let f = features(rng.f64() * 5.0, rng.f64() * 400.0, 0.0);
            m.observe(&e, &f, 2_000.0 + 500.0 * f.decode_ktokens, t0);
        }
        let theta = m.coefficients();
        for (i, (t, prior)) in theta.iter().zip(PRIOR).enumerate() {
            assert!(
                *t >= 0.0 && *t <= MAX_PRIOR_FACTOR * prior + 1e-9,
                "coefficient {i}: {t} (prior {prior})"
            );
        }
        // Pinned at the cap, the decode weight stays well below the prefill one.
        assert!(theta[2] < theta[1], "{theta:?}");
    }
}
