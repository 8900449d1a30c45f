//! Decode time predicted per pool, learned online: what the `predicted_completion` cost adds to
//! the predicted time to first token ([`crate::predict`]) so that a pick prices the whole request.
//!
//! One decode step (an inter-token latency) on an endpoint is modelled as linear in its batch:
//!
//! `itl_ms = φ0 + φ1 · batch + φ2 · kv_ktokens`
//!
//! - `batch`: the requests running there with this one (those kvepp booked there, or a peer
//!   replica did, plus those its engine reports beyond them);
//! - `kv_ktokens`: thousands of tokens of KV the batch reads every step, this request's prompt
//!   included.
//!
//! φ is the pool's ([`DecodeModel`]), fitted by the same recursive least squares as the TTFT
//! model ([`crate::predict::Rls`]: forgetting, θ projected onto `[0, 20 × prior]`, residual
//! clipped), from the end of every streamed response: `(end − first token) / (tokens − 1)`, the
//! mean step it saw, against the features its pick read. What the features do not see — other
//! requests' prefills stretching the steps, which grow with how busy the endpoint is — is learned
//! as part of the batch's coefficients.
//!
//! A candidate's decode cost for a request of `out` output tokens, in ms:
//!
//! - its own decode: `out × itl(batch, kv)`;
//! - the slowdown it adds to the streams already decoding there: each of the `batch − 1` runs
//!   `φ1 + φ2 · own_ktokens` slower per step while both decode, about `min(out, L / 2)` steps (`L`
//!   the mean output length, so `L / 2` a stream's mean remaining);
//! - the stall its prefill puts on them: each waits for the steps that carry the uncached prompt,
//!   `(batch − 1) × own prefill time` (the caller passes the prefill time, from the TTFT model).
//!
//! Output lengths ([`OutputLengths`]): the mean of the lengths observed for the request's model (a
//! bias-corrected running mean, per model up to [`MAX_MODELS`] names, then the pool's;
//! [`PRIOR_OUTPUT_TOKENS`] before any), capped by its `max_tokens` (`max_completion_tokens`) when it
//! gives one.
//!
//! Invariants: predictions are finite and ≥ 0 and never fall with more batch or KV; an
//! observation with fewer than two tokens, a non-finite or negative duration teaches nothing.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::predict::{predict_with, Rls};

const N: usize = 3;

/// The starting coefficients: ms per step, ms per request in the batch, ms per 1k tokens of KV
/// read per step (an 8B model on one H100: ~6 ms reading the weights, KV at ~2 TB/s).
pub const PRIOR: [f64; N] = [6.0, 0.05, 0.06];
/// Prior variances: how far the data may move each coefficient quickly.
const PRIOR_VARIANCE: [f64; N] = [25.0, 0.25, 0.01];

/// Output tokens assumed for a request before any response has been observed.
pub const PRIOR_OUTPUT_TOKENS: f64 = 128.0;
/// Models whose output lengths are kept apart (beyond: the pool's mean).
pub const MAX_MODELS: usize = 1024;
/// Weight of the newest observation in an output-length mean.
const LENGTH_RATE: f64 = 0.05;

/// What the decode model reads for one request on one endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct DecodeFeatures {
    /// Requests running there, this one included.
    pub batch: f64,
    /// Thousands of tokens of KV the batch reads per step, this one's included.
    pub kv_ktokens: f64,
    /// This request's own context, in thousands of tokens (what it adds to every step's reads).
    pub own_ktokens: f64,
    /// Output tokens expected.
    pub output_tokens: f64,
}

impl DecodeFeatures {
    fn vector(&self) -> [f64; N] {
        [1.0, self.batch, self.kv_ktokens]
    }
}

/// The pool's inter-token latency model and output lengths (one per KV-aware picker).
#[derive(Debug)]
pub struct DecodeModel {
    /// The coefficients in use (f64 bits), read without locks on every pick.
    published: [AtomicU64; N],
    fit: Mutex<Rls<N>>,
    lengths: OutputLengths,
}

impl Default for DecodeModel {
    fn default() -> Self {
        DecodeModel {
            published: PRIOR.map(|v| AtomicU64::new(v.to_bits())),
            fit: Mutex::new(Rls::new(PRIOR, PRIOR_VARIANCE)),
            lengths: OutputLengths::default(),
        }
    }
}

impl DecodeModel {
    /// The coefficients in use.
    pub fn coefficients(&self) -> [f64; N] {
        std::array::from_fn(|i| f64::from_bits(self.published[i].load(Ordering::Relaxed)))
    }

    /// Predicted inter-token latency in ms (≥ 0).
    pub fn itl_ms(&self, f: &DecodeFeatures) -> f64 {
        predict_with(&self.coefficients(), &f.vector())
    }

    /// The decode part of a candidate's cost (ms): its own decode, the slowdown it adds to the
    /// streams already there, and the stall `prefill_ms` of its prefill puts on them.
    pub fn cost(&self, f: &DecodeFeatures, prefill_ms: f64) -> f64 {
        let phi = self.coefficients();
        let own = f.output_tokens * predict_with(&phi, &f.vector());
        let others = (f.batch - 1.0).max(0.0);
        let per_step = phi[1].max(0.0) + phi[2].max(0.0) * f.own_ktokens;
        let overlap = f.output_tokens.min(self.lengths.pool_mean() / 2.0);
        let total = own + others * (per_step * overlap + prefill_ms.max(0.0));
        if total.is_finite() {
            total.max(0.0)
        } else {
            0.0
        }
    }

    /// Learns one finished response: `tokens` output tokens whose first came `decode_ms` before
    /// the last, picked with features `f` (the mean step it saw), and its length for `model`.
    pub fn observe(&self, model: Option<&str>, f: &DecodeFeatures, tokens: u64, decode_ms: f64) {
        if tokens == 0 {
            return;
        }
        self.lengths.observe(model, tokens as f64);
        if tokens < 2 || !(decode_ms.is_finite() && decode_ms >= 0.0) {
            return;
        }
        let itl = decode_ms / (tokens - 1) as f64;
        let mut fit = self.fit.lock();
        fit.update(&f.vector(), itl);
        for (slot, v) in self.published.iter().zip(fit.theta) {
            slot.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// Responses whose decode was learned.
    pub fn observed(&self) -> u64 {
        self.fit.lock().observed
    }

    /// The output tokens to expect of a request for `model` that gives `max_tokens` (or none):
    /// the model's mean, capped by `max_tokens` (a cap, which most responses stop short of).
    pub fn output_tokens(&self, model: Option<&str>, max_tokens: Option<u64>) -> f64 {
        let mean = self.lengths.mean(model);
        max_tokens.map_or(mean, |n| mean.min(n as f64))
    }

    pub fn lengths(&self) -> &OutputLengths {
        &self.lengths
    }
}

/// A bias-corrected running mean (the first observations count in full).
#[derive(Debug, Default)]
struct Mean {
    /// (sum, weight) as f64 bits, updated under the table's lock, read without it.
    sum: AtomicU64,
    weight: AtomicU64,
}

impl Mean {
    fn get(&self) -> Option<f64> {
        let w = f64::from_bits(self.weight.load(Ordering::Relaxed));
        (w > 0.0).then(|| f64::from_bits(self.sum.load(Ordering::Relaxed)) / w)
    }

    fn add(&self, v: f64) {
        let s = f64::from_bits(self.sum.load(Ordering::Relaxed));
        let w = f64::from_bits(self.weight.load(Ordering::Relaxed));
        let s = (1.0 - LENGTH_RATE) * s + LENGTH_RATE * v;
        let w = (1.0 - LENGTH_RATE) * w + LENGTH_RATE;
        self.sum.store(s.to_bits(), Ordering::Relaxed);
        self.weight.store(w.to_bits(), Ordering::Relaxed);
    }
}

/// Output lengths observed, per model and over the pool.
#[derive(Debug, Default)]
pub struct OutputLengths {
    pool: Mean,
    models: RwLock<HashMap<Box<str>, Mean>>,
    /// Serialises updates (reads take no lock but the table's, shared).
    update: Mutex<()>,
}

impl OutputLengths {
    /// The pool's mean output length ([`PRIOR_OUTPUT_TOKENS`] before any).
    pub fn pool_mean(&self) -> f64 {
        self.pool.get().unwrap_or(PRIOR_OUTPUT_TOKENS)
    }

    /// The mean output length of `model` (the pool's when it has none yet).
    pub fn mean(&self, model: Option<&str>) -> f64 {
        model
            .and_then(|m| self.models.read().get(m).and_then(Mean::get))
            .unwrap_or_else(|| self.pool_mean())
    }

    fn observe(&self, model: Option<&str>, tokens: f64) {
        if !(tokens.is_finite() && tokens > 0.0) {
            return;
        }
        let _one = self.update.lock();
        self.pool.add(tokens);
        let Some(m) = model else { return };
        if let Some(mean) = self.models.read().get(m) {
            mean.add(tokens);
            return;
        }
        let mut models = self.models.write();
        if models.len() < MAX_MODELS {
            models.entry(m.into()).or_default().add(tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features(batch: f64, kv: f64, out: f64) -> DecodeFeatures {
        DecodeFeatures {
            batch,
            kv_ktokens: kv,
            own_ktokens: 1.0,
            output_tokens: out,
        }
    }

    #[test]
    fn learns_an_engine_whose_steps_grow_with_its_batch() {
        let m = DecodeModel::default();
        // The truth: 9 ms a step + 0.4 ms per request + 0.05 ms per 1k tokens read.
        let truth = |f: &DecodeFeatures| 9.0 + 0.4 * f.batch + 0.05 * f.kv_ktokens;
        let mut rng = fastrand::Rng::with_seed(5);
        for _ in 0..600 {
            let f = features(1.0 + rng.f64() * 40.0, rng.f64() * 300.0, 100.0);
            m.observe(Some("m"), &f, 101, 100.0 * truth(&f));
        }
        let f = features(20.0, 100.0, 100.0);
        let itl = m.itl_ms(&f);
        assert!(
            (itl - truth(&f)).abs() < 0.05 * truth(&f),
            "{itl} vs {}",
            truth(&f)
        );
        assert_eq!(m.observed(), 600);
        assert!((m.lengths().mean(Some("m")) - 101.0).abs() < 1e-9);
    }

    #[test]
    fn a_busier_endpoint_costs_more_and_the_cost_counts_the_others() {
        let m = DecodeModel::default();
        let idle = features(1.0, 1.0, 200.0);
        let busy = features(30.0, 200.0, 200.0);
        assert!(m.cost(&busy, 0.0) > m.cost(&idle, 0.0));
        // Alone, the cost is the request's own decode; with others its prefill stalls each.
        assert!((m.cost(&idle, 50.0) - 200.0 * m.itl_ms(&idle)).abs() < 1e-9);
        let stall = m.cost(&busy, 50.0) - m.cost(&busy, 0.0);
        assert!((stall - 29.0 * 50.0).abs() < 1e-9, "{stall}");
        // More output tokens never cost less.
        assert!(m.cost(&features(30.0, 200.0, 400.0), 0.0) > m.cost(&busy, 0.0));
    }

    #[test]
    fn output_lengths_are_what_each_model_produced_capped_by_max_tokens() {
        let m = DecodeModel::default();
        assert_eq!(m.output_tokens(Some("a"), Some(64)), 64.0);
        assert_eq!(m.output_tokens(Some("a"), Some(4096)), PRIOR_OUTPUT_TOKENS);
        assert_eq!(m.output_tokens(Some("a"), None), PRIOR_OUTPUT_TOKENS);
        let f = features(1.0, 1.0, 1.0);
        for _ in 0..50 {
            m.observe(Some("a"), &f, 40, 100.0);
            m.observe(Some("b"), &f, 400, 100.0);
        }
        assert!((m.output_tokens(Some("a"), None) - 40.0).abs() < 1e-9);
        assert!((m.output_tokens(Some("b"), None) - 400.0).abs() < 1e-9);
        assert_eq!(m.output_tokens(Some("b"), Some(100)), 100.0);
        // An unknown model reads the pool's mean.
        let pool = m.output_tokens(Some("c"), None);
        assert!(pool > 40.0 && pool < 400.0, "{pool}");
    }

    #[test]
    fn garbage_teaches_nothing_and_predictions_stay_sane() {
        let m = DecodeModel::default();
        let f = features(4.0, 10.0, 10.0);
        let before = m.coefficients();
        m.observe(None, &f, 1, 5.0);
        m.observe(None, &f, 10, f64::NAN);
        m.observe(None, &f, 10, -1.0);
        m.observe(None, &f, 0, 10.0);
        assert_eq!(m.coefficients(), before);
        for _ in 0..200 {
            m.observe(None, &f, 10, 0.0);
        }
        assert!(m.coefficients().iter().all(|c| c.is_finite() && *c >= 0.0));
        assert!(m.cost(&f, 10.0) >= 0.0);
        let nan = DecodeFeatures {
            output_tokens: f64::NAN,
            ..f
        };
        assert_eq!(m.cost(&nan, 0.0), 0.0);
    }
}
