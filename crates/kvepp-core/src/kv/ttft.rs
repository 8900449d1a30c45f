//! What the KV-aware picker reads of the pool's TTFT model for one pick (the `predicted_ttft`
//! cost): each candidate's features, and for a request with a TTFT budget the chosen endpoint's
//! prediction and the idle floor the objective's filter compares it with. Reads only; the model
//! learns in the booking's guard.

use std::sync::Arc;
use std::time::Instant;

use super::{CandidateLoad, CostWeights, EndpointLoad, KvDecision, KvState, PickScratch};
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

impl KvState {
    /// For a request with a TTFT budget under the predicted-TTFT cost: the chosen endpoint's
    /// (`best`) prediction and the idle floor over the candidates (`sc.loads` are theirs).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn outlook(
        &self,
        d: &KvDecision,
        req: &PickRequest<'_>,
        candidates: &[Arc<Endpoint>],
        best: usize,
        sc: &PickScratch,
        (w, bs, isl): (&CostWeights, u32, u64),
        now: Instant,
    ) -> Option<crate::predict::TtftOutlook> {
        let f = d.ttft.filter(|_| req.ttft_budget_ms.is_some())?;
        let own = sc.loads.iter().zip(candidates).map(|(c, e)| {
            let k = w.effective_prefill_tokens(isl, bs, c.overlap) as f64 / 1000.0;
            (&*e.load.ttft, k)
        });
        let now = crate::load::clock_nanos(now);
        Some(
            self.ttft
                .outlook((&candidates[best].load.ttft, &f), own, now),
        )
    }
}
