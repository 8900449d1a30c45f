//! What the KV-aware picker reads of the pool's predictions for one pick (the `predicted_ttft`
//! and `predicted_completion` costs): each candidate's TTFT and decode features, its predicted
//! cost, which candidates are predicted to miss the request's objectives, and for a request with
//! objectives the chosen endpoint's predictions and the idle floor the objectives' filter
//! compares them with. Reads only; the models learn in the booking's guard.

use std::sync::Arc;

use super::{CandidateLoad, CostWeights, EndpointLoad, KvDecision, KvState, PickScratch};
use crate::cost::CostModel;
use crate::decode::DecodeFeatures;
use crate::predict::TtftFeatures;
use crate::{Endpoint, PickRequest};

/// What the predicted-TTFT model reads for one candidate: the prefill queued there plus this
/// prompt's uncached part, the decoding KV (with this request's), the engine's hidden requests.
pub(super) fn ttft_features(
    w: &CostWeights,
    bs: u32,
    isl: u64,
    c: &CandidateLoad,
    load: &EndpointLoad,
) -> TtftFeatures {
    let own = w.effective_prefill_tokens(isl, bs, c.overlap);
    let queued = c.potential_prefill_tokens.saturating_sub(isl);
    TtftFeatures {
        uncached_ktokens: own as f64 / 1000.0,
        prefill_ktokens: (queued + own) as f64 / 1000.0,
        decode_ktokens: c.potential_decode_blocks as f64 * f64::from(bs) / 1000.0,
        hidden_requests: f64::from(load.hidden_requests()),
    }
}

/// What the decode model reads for one candidate: the batch with this request (the requests
/// booked there and those its engine reports beyond them), the KV they read per step with this
/// prompt's, this request's own context at mid-decode and its expected output.
pub(super) fn decode_features(
    bs: u32,
    isl: u64,
    c: &CandidateLoad,
    load: &EndpointLoad,
    output_tokens: f64,
) -> DecodeFeatures {
    let others = c.active_requests.saturating_add(load.hidden_requests());
    DecodeFeatures {
        batch: f64::from(others) + 1.0,
        kv_ktokens: c.potential_decode_blocks as f64 * f64::from(bs) / 1000.0,
        own_ktokens: (isl as f64 + output_tokens / 2.0) / 1000.0,
        output_tokens,
    }
}

/// One pick's view of the predicted costs: the cost model, the time, the output tokens expected.
#[derive(Debug, Clone, Copy)]
pub(super) struct Predicting {
    pub(super) model: CostModel,
    pub(super) now: i64,
    pub(super) output_tokens: f64,
    /// The request states a TTFT or TPOT objective.
    pub(super) objectives: bool,
}

impl KvState {
    /// The predicted costs' view of a pick for `req` at `now`.
    pub(super) fn predicting(
        &self,
        w: &CostWeights,
        req: &PickRequest<'_>,
        now: std::time::Instant,
    ) -> Option<Predicting> {
        w.cost_model.predicts().then(|| Predicting {
            model: w.cost_model,
            now: crate::load::clock_nanos(now),
            output_tokens: self.decode.output_tokens(req.model, req.max_tokens),
            objectives: req.ttft_budget_ms.is_some() || req.tpot_budget_ms.is_some(),
        })
    }

    /// Candidate `c`'s predicted cost (ms) on `load` — its TTFT (with the eviction term) and,
    /// under the predicted-completion cost, its decode and what it adds to the others there —
    /// and, for a request with objectives, whether it is predicted to miss its TTFT budget or
    /// its TPOT objective (false without objectives). Each feature set is computed once.
    pub(super) fn predicted(
        &self,
        p: &Predicting,
        req: &PickRequest<'_>,
        (w, bs, isl): (&CostWeights, u32, u64),
        c: &CandidateLoad,
        load: &EndpointLoad,
    ) -> (f64, bool) {
        let f = ttft_features(w, bs, isl, c, load);
        let ttft = self.ttft.cost(&load.ttft, &f, p.now);
        let completion = p.model == CostModel::PredictedCompletion;
        let d = (completion || req.tpot_budget_ms.is_some())
            .then(|| decode_features(bs, isl, c, load, p.output_tokens));
        let cost = match d.filter(|_| completion) {
            Some(d) => {
                let prefill = self.ttft.prefill_ms(&load.ttft, f.uncached_ktokens, p.now);
                ttft + self.decode.cost(&d, prefill)
            }
            None => ttft,
        };
        let late = req
            .ttft_budget_ms
            .is_some_and(|b| self.ttft.predict_at(&load.ttft, &f, p.now) > b);
        let slow = req
            .tpot_budget_ms
            .zip(d)
            .is_some_and(|(b, d)| self.decode.itl_ms(&d) > b);
        (cost, late || slow)
    }

    /// For a request with objectives under a predicted cost: the chosen endpoint's (`best`)
    /// predictions and the idle floor over the candidates (`sc.loads` are theirs).
    pub(super) fn outlook(
        &self,
        d: &KvDecision,
        p: Option<&Predicting>,
        candidates: &[Arc<Endpoint>],
        best: usize,
        sc: &PickScratch,
        (w, bs, isl): (&CostWeights, u32, u64),
    ) -> Option<crate::predict::TtftOutlook> {
        let p = p.filter(|p| p.objectives)?;
        let f = d.ttft?;
        let own = sc.loads.iter().zip(candidates).map(|(c, e)| {
            let k = w.effective_prefill_tokens(isl, bs, c.overlap) as f64 / 1000.0;
            (&*e.load.ttft, k)
        });
        let outlook = self
            .ttft
            .outlook((&candidates[best].load.ttft, &f), own, p.now);
        let alone = |f: DecodeFeatures| DecodeFeatures {
            batch: 1.0,
            kv_ktokens: f.own_ktokens,
            ..f
        };
        let itl = d.decode.map(|f| self.decode.itl_ms(&f));
        Some(crate::predict::TtftOutlook {
            itl_ms: itl,
            itl_floor_ms: d
                .decode
                .zip(itl)
                .map(|(f, itl)| self.decode.itl_ms(&alone(f)).min(itl)),
            ..outlook
        })
    }
}
