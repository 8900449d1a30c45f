//! Least in-flight requests, random tie-break (the load-only picker).

use std::sync::Arc;

use super::{Endpoint, PickContext, PickRequest, Picker, Ranked};

#[derive(Debug, Default, Clone, Copy)]
pub struct LeastLoaded;

impl Picker for LeastLoaded {
    fn rank(
        &self,
        candidates: &[Arc<Endpoint>],
        _: &PickRequest<'_>,
        ctx: &mut PickContext,
    ) -> Ranked {
        // Requests in flight, plus the caller's bias (a decode pick's transfer cost) when given.
        let load = |i: usize| {
            f64::from(candidates[i].load.in_flight()) + ctx.bias.get(i).copied().unwrap_or(0.0)
        };
        let best = argmin(candidates.len(), None, load, &mut ctx.rng);
        let second = (candidates.len() > 1)
            .then(|| argmin(candidates.len(), Some(best), load, &mut ctx.rng));
        if let Some(scores) = &mut ctx.scores {
            scores.clear();
            scores.extend((0..candidates.len()).map(|i| 1.0 / (1.0 + load(i).max(0.0))));
        }
        Ranked {
            best,
            second,
            kv: None,
        }
    }
}

/// Index of the smallest key among `0..n` except `skip`, ties broken uniformly at random
/// (reservoir sampling, no allocation).
fn argmin(
    n: usize,
    skip: Option<usize>,
    key: impl Fn(usize) -> f64,
    rng: &mut fastrand::Rng,
) -> usize {
    let mut best = usize::MAX;
    let mut best_key = f64::INFINITY;
    let mut ties = 0u32;
    for i in (0..n).filter(|&i| Some(i) != skip) {
        let k = key(i);
        if best == usize::MAX || k < best_key {
            best = i;
            best_key = k;
            ties = 1;
        } else if k == best_key {
            ties += 1;
            if rng.u32(..ties) == 0 {
                best = i;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pick::tests::ep;
    use crate::PickContext;

    #[test]
    fn ties_are_spread() {
        let eps = [ep(1, 2), ep(2, 2), ep(3, 2), ep(4, 7)];
        let refs = &eps[..];
        let mut ctx = PickContext::seeded(7);
        let mut seen = [0u32; 4];
        for _ in 0..3000 {
            let Ranked { best, second, .. } =
                LeastLoaded.rank(refs, &PickRequest::default(), &mut ctx);
            assert_ne!(Some(best), second);
            assert_ne!(second, Some(3));
            seen[best] += 1;
        }
        assert_eq!(seen[3], 0);
        for s in &seen[..3] {
            assert!(*s > 700, "uneven tie-break: {seen:?}");
        }
    }

    #[test]
    fn single_candidate() {
        let eps = [ep(1, 0)];
        let mut ctx = PickContext::seeded(7);
        let r = LeastLoaded.rank(&eps, &PickRequest::default(), &mut ctx);
        assert_eq!((r.best, r.second), (0, None));
    }
}
