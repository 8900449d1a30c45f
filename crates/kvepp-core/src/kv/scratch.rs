//! A pick's reusable buffers: taken from a pool and given back, so a pick allocates none of them
//! in steady state.
//!
//! Invariants: a [`CandidateMap`] maps each worker id to its first candidate's index, and is empty
//! after `clear`; buffers keep their capacity between picks.

use crate::cost::{BoundInput, CandidateLoad};
use crate::index::MatchScratch;
use crate::slots::HeldScratch;
use crate::types::{Overlap, RankOverlap};

/// Worker id → candidate index for one pick: open addressing over reused arrays (no hashing of
/// addresses, no allocation once grown).
#[derive(Debug, Default)]
pub(super) struct CandidateMap {
    pub(super) keys: Vec<u64>,
    /// Candidate index + 1; 0: empty.
    pub(super) vals: Vec<u32>,
    pub(super) len: usize,
}

impl CandidateMap {
    fn slot(&self, key: u64) -> usize {
        // Worker ids are already hashes of the address: one multiply spreads them.
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & (self.keys.len() - 1)
    }

    pub(super) fn clear(&mut self) {
        if self.len > 0 {
            self.vals.fill(0);
            self.len = 0;
        }
    }

    pub(super) fn build(&mut self, workers: impl ExactSizeIterator<Item = u64>) {
        let cap = (workers.len() * 2).next_power_of_two().max(16);
        if self.keys.len() != cap {
            self.keys = vec![0; cap];
            self.vals = vec![0; cap];
        }
        let mask = cap - 1;
        for (i, w) in workers.enumerate() {
            let mut at = self.slot(w);
            while self.vals[at] != 0 && self.keys[at] != w {
                at = (at + 1) & mask;
            }
            if self.vals[at] == 0 {
                self.keys[at] = w;
                self.vals[at] = i as u32 + 1;
                self.len += 1;
            }
        }
    }

    #[inline]
    pub(super) fn get(&self, w: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.keys.len() - 1;
        let mut at = self.slot(w);
        loop {
            match self.vals[at] {
                0 => return None,
                v if self.keys[at] == w => return Some(v as usize - 1),
                _ => at = (at + 1) & mask,
            }
        }
    }
}

/// Reusable buffers of one pick (taken from and returned to a pool, so a pick allocates none of
/// them in steady state).
#[derive(Debug, Default)]
pub(super) struct PickScratch {
    pub(super) matching: MatchScratch,
    pub(super) found: Vec<RankOverlap>,
    /// Overlaps of the workers whose events are in fallback (worker, overlap), when any.
    pub(super) fallback: Vec<(u64, Overlap)>,
    /// The walk over the slot tracker's active blocks.
    pub(super) held: HeldScratch,
    /// Candidate index by worker id (the first candidate of a worker).
    pub(super) by_worker: CandidateMap,
    /// Per candidate: best cached overlap over its worker's ranks (where ranks other than 0
    /// exist).
    pub(super) best: Vec<Overlap>,
    /// Per candidate, under a predicted cost only (Dynamo's keeps just the costs and reads the
    /// chosen one's load again).
    pub(super) loads: Vec<CandidateLoad>,
    pub(super) versions: Vec<Option<u64>>,
    pub(super) costs: Vec<f64>,
    /// Per candidate, with bounded loads on: what they read (requests held, prompt blocks
    /// cached); empty when they are off.
    pub(super) requests: Vec<BoundInput>,
    /// Per candidate, for a request with objectives under a predicted cost: predicted to miss
    /// one; empty otherwise.
    pub(super) missed: Vec<bool>,
    /// Candidates whose tracker hint missed, with the load resolved for them through the tracker's rank map.
    pub(super) resolved: Vec<(usize, CandidateLoad, Option<u64>)>,
    /// An ordered pick's ([`super::ordered`]): the candidates it costed, which of them it
    /// has (`seen[i] == epoch`), and the costs it chooses among.
    pub(super) visits: Vec<Visit>,
    pub(super) seen: Vec<u32>,
    pub(super) epoch: u32,
    pub(super) close: Vec<f64>,
    /// How many candidates an ordered pick may cost before it leaves the pick to the scan.
    pub(super) budget: usize,
    /// An ordered pick's walk over the ranks by load.
    pub(super) by_load: crate::slots::VisitScratch,
    /// Reads of one rank's cached prefix the ordered pick made (see `ordered::read_cached`).
    pub(super) lazy_reads: usize,
    pub(super) materialize_at: usize,
    /// Ranks the ordered pick's walk by load read (what the tests bound).
    pub(super) walk_reads: usize,
}

/// A candidate an ordered pick has costed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Visit {
    pub(super) i: u32,
    pub(super) cost: f64,
    pub(super) load: CandidateLoad,
    pub(super) version: u64,
}
