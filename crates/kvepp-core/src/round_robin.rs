//! Round robin over the candidates, ignoring load and prefix (the baseline of the routing
//! benchmark, and what a plain Kubernetes Service gives).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::{Endpoint, PickContext, PickRequest, Picker, Ranked};

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Picker for RoundRobin {
    fn rank(
        &self,
        candidates: &[Arc<Endpoint>],
        _: &PickRequest<'_>,
        ctx: &mut PickContext,
    ) -> Ranked {
        let n = candidates.len();
        let best = self.next.fetch_add(1, Ordering::Relaxed) % n;
        // Round robin has no preference: the one whose turn it is scores 1, the others 0.
        if let Some(scores) = &mut ctx.scores {
            scores.clear();
            scores.extend((0..n).map(|i| if i == best { 1.0 } else { 0.0 }));
        }
        Ranked {
            best,
            second: (n > 1).then(|| (best + 1) % n),
            kv: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pick::tests::ep;
    use crate::PickContext;

    #[test]
    fn cycles_through_candidates_whatever_their_load() {
        let eps = [ep(1, 0), ep(2, 50), ep(3, 0)];
        let refs = &eps[..];
        let mut ctx = PickContext::seeded(7);
        let rr = RoundRobin::default();
        let picks: Vec<(usize, Option<usize>)> = (0..6)
            .map(|_| {
                let r = rr.rank(refs, &PickRequest::default(), &mut ctx);
                (r.best, r.second)
            })
            .collect();
        assert_eq!(
            picks,
            vec![
                (0, Some(1)),
                (1, Some(2)),
                (2, Some(0)),
                (0, Some(1)),
                (1, Some(2)),
                (2, Some(0))
            ]
        );
        assert_eq!(
            rr.rank(&refs[..1], &PickRequest::default(), &mut ctx)
                .second,
            None
        );
    }
}
