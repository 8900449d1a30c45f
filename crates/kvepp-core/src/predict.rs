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
//!   those routed here: another client's traffic, which only the engine's own metrics show.
//!
//! θ starts from an 8B model on one H100 (≈25k prefill tokens/s) and is refit by recursive least
//! squares with forgetting each time a streamed response's first chunk arrives (the observed
//! TTFT of a request whose features were recorded at its pick), per endpoint, so each engine's
//! own speed is learned. Invariants: predictions are never negative (coefficients are used
//! clamped at ≥ 0); an observation's residual is clipped, so one request stuck behind an engine
//! restart does not swing the model; the covariance is bounded (no wind-up along features that
//! stay at 0).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

/// What the model reads for one request on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TtftFeatures {
    pub prefill_ktokens: f64,
    pub decode_ktokens: f64,
    pub hidden_requests: f64,
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

#[derive(Debug, Clone)]
struct Rls {
    theta: [f64; N],
    p: [[f64; N]; N],
    observed: u64,
}

impl Default for Rls {
    fn default() -> Self {
        let mut p = [[0.0; N]; N];
        for (i, v) in PRIOR_VARIANCE.iter().enumerate() {
            p[i][i] = *v;
        }
        Rls {
            theta: PRIOR,
            p,
            observed: 0,
        }
    }
}

impl Rls {
    fn update(&mut self, x: &[f64; N], y: f64) {
        let predicted = predict_with(&self.theta, x);
        // Clip the residual: a TTFT 5× (+ 50 ms) off the prediction counts as that much.
        let limit = 5.0 * predicted + 50.0;
        let residual = (y - predicted).clamp(-limit, limit);
        let px: [f64; N] = std::array::from_fn(|i| (0..N).map(|j| self.p[i][j] * x[j]).sum());
        let denom = FORGET + (0..N).map(|i| x[i] * px[i]).sum::<f64>();
        if !(denom.is_finite() && denom > 0.0) {
            return;
        }
        let k: [f64; N] = std::array::from_fn(|i| px[i] / denom);
        for (t, ki) in self.theta.iter_mut().zip(k) {
            *t += ki * residual;
        }
        for i in 0..N {
            for j in 0..N {
                self.p[i][j] = (self.p[i][j] - k[i] * px[j]) / FORGET;
            }
        }
        let trace: f64 = (0..N).map(|i| self.p[i][i]).sum();
        let cap = MAX_TRACE_FACTOR * PRIOR_VARIANCE.iter().sum::<f64>();
        if trace > cap {
            let s = cap / trace;
            self.p.iter_mut().flatten().for_each(|v| *v *= s);
        }
        if self.theta.iter().any(|t| !t.is_finite()) {
            *self = Rls::default();
        }
        self.observed += 1;
    }
}

fn predict_with(theta: &[f64; N], x: &[f64; N]) -> f64 {
    theta.iter().zip(x).map(|(t, v)| t.max(0.0) * v).sum()
}

/// One endpoint's TTFT model: read without locks on every pick, refit under a lock on every
/// observed first token.
#[derive(Debug)]
pub struct TtftEstimator {
    /// The coefficients in use (f64 bits).
    published: [AtomicU64; N],
    fit: Mutex<Rls>,
}

impl Default for TtftEstimator {
    fn default() -> Self {
        TtftEstimator {
            published: PRIOR.map(|v| AtomicU64::new(v.to_bits())),
            fit: Mutex::new(Rls::default()),
        }
    }
}

impl TtftEstimator {
    /// The coefficients in use.
    pub fn coefficients(&self) -> [f64; N] {
        std::array::from_fn(|i| f64::from_bits(self.published[i].load(Ordering::Relaxed)))
    }

    /// Predicted TTFT in ms (≥ 0).
    pub fn predict(&self, f: &TtftFeatures) -> f64 {
        predict_with(&self.coefficients(), &f.vector())
    }

    /// Refits with one observed TTFT for a request picked with features `f`.
    pub fn observe(&self, f: &TtftFeatures, ttft_ms: f64) {
        if !(ttft_ms.is_finite() && ttft_ms >= 0.0) {
            return;
        }
        let mut fit = self.fit.lock().unwrap_or_else(PoisonError::into_inner);
        fit.update(&f.vector(), ttft_ms);
        for (slot, v) in self.published.iter().zip(fit.theta) {
            slot.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// First tokens observed so far.
    pub fn observed(&self) -> u64 {
        self.fit
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .observed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(p: f64, d: f64, h: f64) -> TtftFeatures {
        TtftFeatures {
            prefill_ktokens: p,
            decode_ktokens: d,
            hidden_requests: h,
        }
    }

    #[test]
    fn learns_an_engine_slower_than_the_prior() {
        let e = TtftEstimator::default();
        let before = e.predict(&features(4.0, 10.0, 0.0));
        assert!((before - (5.0 + 160.0 + 1.0)).abs() < 1e-9, "{before}");
        // The truth: 12 ms + 100 ms per 1k prompt tokens + 2 ms per 1k decoding tokens.
        let truth = |f: &TtftFeatures| 12.0 + 100.0 * f.prefill_ktokens + 2.0 * f.decode_ktokens;
        let mut rng = fastrand::Rng::with_seed(3);
        for _ in 0..400 {
            let f = features(rng.f64() * 8.0, rng.f64() * 40.0, 0.0);
            e.observe(&f, truth(&f));
        }
        let f = features(4.0, 10.0, 0.0);
        let after = e.predict(&f);
        assert!((after - truth(&f)).abs() < 0.05 * truth(&f), "{after} vs {}", truth(&f));
        assert_eq!(e.observed(), 400);
        // The never-seen feature kept its prior and the covariance stayed bounded.
        assert!((e.coefficients()[3] - PRIOR[3]).abs() < 1.0);
    }

    #[test]
    fn outliers_and_garbage_do_not_break_it() {
        let e = TtftEstimator::default();
        let f = features(1.0, 0.0, 0.0);
        for _ in 0..50 {
            e.observe(&f, 45.0);
        }
        let steady = e.predict(&f);
        e.observe(&f, 60_000.0);
        e.observe(&f, f64::NAN);
        e.observe(&f, -3.0);
        let after = e.predict(&f);
        assert!(after < steady * 8.0, "{steady} → {after}");
        assert!(e.coefficients().iter().all(|c| c.is_finite()));
        // Predictions never go negative, whatever the fit.
        for _ in 0..200 {
            e.observe(&features(5.0, 0.0, 0.0), 0.0);
        }
        assert!(e.predict(&features(0.0, 0.0, 3.0)) >= 0.0);
    }
}
