//! Endpoints whose KV events cannot be matched against the pool's index, and the block size
//! each endpoint reports.
//!
//! An endpoint is in fallback while at least one reason holds: its events stopped decoding
//! ([`FallbackReason::Undecodable`], until a batch decodes again), or it reports a block size
//! other than the pool's ([`FallbackReason::BlockSize`]: its blocks hash to other sequence
//! hashes than the prompt's, so its events say nothing about them). A token prompt's cached
//! prefix on such an endpoint is what was routed to it, as in approximate mode.
//!
//! The pool's block size is the configured one, or (learned) the size most reporting endpoints
//! report; a tie keeps the size in use if it is among the tied, else takes the smallest.
//!
//! Invariants: `on` is sorted and holds exactly the workers with a non-empty reason set; a
//! forgotten worker leaves both tables. Picks read `on` only (one atomic load); the tables
//! change under one lock, off the pick path.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Why an endpoint's events are not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FallbackReason {
    /// Its last KV-event batch did not decode.
    Undecodable = 1,
    /// It reports a block size other than the pool's.
    BlockSize = 2,
}

#[derive(Debug, Default)]
struct Tables {
    /// Reasons per worker in fallback (bit set of [`FallbackReason`]).
    reasons: HashMap<u64, u8>,
    /// The block size each worker reported last.
    sizes: HashMap<u64, u32>,
}

#[derive(Debug)]
pub(super) struct Fallback {
    tables: Mutex<Tables>,
    /// Workers in fallback, sorted: what picks read.
    on: arc_swap::ArcSwap<Vec<u64>>,
}

impl Default for Fallback {
    fn default() -> Self {
        Fallback {
            tables: Mutex::default(),
            on: arc_swap::ArcSwap::from_pointee(Vec::new()),
        }
    }
}

impl Fallback {
    /// The workers in fallback now (sorted), for one pick.
    pub(super) fn workers(&self) -> Arc<Vec<u64>> {
        self.on.load_full()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.on.load().is_empty()
    }

    pub(super) fn contains(&self, worker: u64) -> bool {
        self.on.load().binary_search(&worker).is_ok()
    }

    /// Sets or clears `reason` for `worker`; returns whether that changed the reason.
    pub(super) fn set(&self, worker: u64, reason: FallbackReason, on: bool) -> bool {
        let mut t = self.tables.lock();
        let changed = Self::set_locked(&mut t, worker, reason, on);
        if changed {
            self.publish(&t);
        }
        changed
    }

    fn set_locked(t: &mut Tables, worker: u64, reason: FallbackReason, on: bool) -> bool {
        let bit = reason as u8;
        let cur = t.reasons.get(&worker).copied().unwrap_or(0);
        let next = if on { cur | bit } else { cur & !bit };
        if next == cur {
            return false;
        }
        if next == 0 {
            t.reasons.remove(&worker);
        } else {
            t.reasons.insert(worker, next);
        }
        true
    }

    fn publish(&self, t: &Tables) {
        let mut on: Vec<u64> = t.reasons.keys().copied().collect();
        on.sort_unstable();
        self.on.store(Arc::new(on));
    }

    /// `worker` reported block size `bs`. Returns the pool's block size afterwards (`configured`
    /// when given, else the most reported; `current` is the one in use), and marks every worker
    /// whose reported size differs from it.
    pub(super) fn report_block_size(
        &self,
        worker: u64,
        bs: u32,
        configured: Option<u32>,
        current: u32,
    ) -> u32 {
        let mut t = self.tables.lock();
        if t.sizes.insert(worker, bs) == Some(bs) {
            return current;
        }
        let pool = configured.unwrap_or_else(|| most_reported(&t.sizes, current));
        let mut changed = false;
        let sizes: Vec<(u64, u32)> = t.sizes.iter().map(|(&w, &s)| (w, s)).collect();
        for (w, s) in sizes {
            changed |= Self::set_locked(&mut t, w, FallbackReason::BlockSize, s != pool);
        }
        if changed {
            self.publish(&t);
        }
        pool
    }

    /// Forgets `worker` (it left the pool).
    pub(super) fn forget(&self, worker: u64) {
        let mut t = self.tables.lock();
        t.sizes.remove(&worker);
        if t.reasons.remove(&worker).is_some() {
            self.publish(&t);
        }
    }
}

/// The block size most workers report; a tie keeps `current` if it is among the tied, else
/// the smallest.
fn most_reported(sizes: &HashMap<u64, u32>, current: u32) -> u32 {
    let mut counts: HashMap<u32, usize> = HashMap::new();
    for &s in sizes.values() {
        *counts.entry(s).or_default() += 1;
    }
    let top = counts.values().copied().max().unwrap_or(0);
    if counts.get(&current) == Some(&top) {
        return current;
    }
    counts
        .into_iter()
        .filter(|&(_, n)| n == top)
        .map(|(s, _)| s)
        .min()
        .unwrap_or(current)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_kept_apart_and_the_set_stays_sorted() {
        let f = Fallback::default();
        assert!(f.set(9, FallbackReason::Undecodable, true));
        assert!(f.set(3, FallbackReason::BlockSize, true));
        assert!(!f.set(3, FallbackReason::BlockSize, true));
        assert_eq!(*f.workers(), vec![3, 9]);
        assert!(f.set(9, FallbackReason::BlockSize, true));
        // Decoding again leaves the block-size reason standing.
        assert!(f.set(9, FallbackReason::Undecodable, false));
        assert!(f.contains(9));
        assert!(f.set(9, FallbackReason::BlockSize, false));
        assert!(!f.contains(9));
        f.forget(3);
        assert!(f.is_empty());
    }

    #[test]
    fn the_pool_block_size_is_the_most_reported_and_the_others_fall_back() {
        let f = Fallback::default();
        assert_eq!(f.report_block_size(1, 32, None, 16), 32);
        assert!(f.is_empty());
        // A tie keeps the size in use.
        assert_eq!(f.report_block_size(2, 1, None, 32), 32);
        assert_eq!(*f.workers(), vec![2]);
        // The most reported wins; the one left over falls back.
        assert_eq!(f.report_block_size(3, 1, None, 32), 1);
        assert_eq!(*f.workers(), vec![1]);
        // Configured: every other size falls back.
        let g = Fallback::default();
        assert_eq!(g.report_block_size(1, 32, Some(16), 16), 16);
        assert_eq!(g.report_block_size(2, 16, Some(16), 16), 16);
        assert_eq!(*g.workers(), vec![1]);
        // Reporting the pool's size ends it.
        assert_eq!(g.report_block_size(1, 16, Some(16), 16), 16);
        assert!(g.is_empty());
    }

    #[test]
    fn a_tie_without_the_current_size_takes_the_smallest() {
        let sizes = HashMap::from([(1, 64), (2, 32)]);
        assert_eq!(most_reported(&sizes, 16), 32);
        assert_eq!(most_reported(&HashMap::new(), 16), 16);
    }
}
