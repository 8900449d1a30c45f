//! Each rank's bound on the (block, rank) pairs it holds, and which pair goes when a store would
//! pass it.
//!
//! An engine holds at most the blocks its KV cache has room for; a publisher that never sends
//! removals (a bug, or removals lost while kvepp was away) would otherwise grow the index without
//! end. So each rank has a limit — `max_blocks_per_rank`, lowered by
//! [`PrefixIndex::set_rank_limit`] to what the engine reports plus a margin — and a store of a
//! pair the rank does not hold, with the rank at its limit, first drops the rank's oldest pair
//! (every tier's references to it), counted in [`super::IndexStats::evicted`].
//!
//! "Oldest" is by the order pairs were stored: each new pair is appended to the rank's `order`;
//! dropping pops from the front, skipping entries whose pair is no longer held. Removed pairs
//! leave entries behind, so the list is compacted (entries of pairs not held dropped, one entry
//! per pair kept, the first) when it grows past twice the rank's pairs plus [`SLACK`]: memory
//! stays proportional to the pairs held.
//!
//! Invariants: a rank never holds more pairs than its limit; the engine hash recorded with a
//! pair's entry is forgotten with the pair; the same operations give the same result on equal
//! indexes (the shared index applies each twice).

use std::collections::HashSet;

use super::{EngineBlockHash, Holders, IndexError, PrefixIndex};
use crate::hash::SequenceHash;
use crate::types::WorkerRank;

/// Stale entries tolerated beyond twice the pairs before the order list is compacted.
pub const SLACK: usize = 64;

impl PrefixIndex {
    /// Sets the pairs `rank` may hold (at most `max_blocks_per_rank`), dropping its oldest pairs
    /// down to it; returns how many went.
    pub fn set_rank_limit(&mut self, rank: WorkerRank, limit: u64) -> Result<u64, IndexError> {
        let s = self.slot_or_insert(rank)?;
        let limit = limit.clamp(1, self.max_blocks_per_rank);
        Self::slot_mut(&mut self.ranks, s).limit = limit;
        let mut dropped = 0;
        while self.slot(s).blocks > limit && self.evict_oldest(s) {
            dropped += 1;
        }
        Ok(dropped)
    }

    /// The pairs `rank` may hold (`max_blocks_per_rank` for a rank the index does not know).
    pub fn rank_limit(&self, rank: WorkerRank) -> u64 {
        self.slot_of(rank)
            .map_or(self.max_blocks_per_rank, |s| self.slot(s).limit)
    }

    /// Before storing `seq` on slot `s`: when that makes a new pair and the rank is at its limit,
    /// drops the rank's oldest pair.
    pub(super) fn make_room(&mut self, s: u16, seq: SequenceHash) {
        let slot = self.slot(s);
        if slot.blocks >= slot.limit && !self.holds(s, seq) {
            self.evict_oldest(s);
        }
    }

    /// `seq` became a pair of slot `s`, known to the engine as `engine`.
    pub(super) fn note_new(&mut self, s: u16, seq: SequenceHash, engine: EngineBlockHash) {
        let slot = Self::slot_mut(&mut self.ranks, s);
        slot.order.push_back((seq, engine));
        let bound = usize::try_from(slot.blocks)
            .unwrap_or(usize::MAX)
            .saturating_mul(2)
            .saturating_add(SLACK);
        if slot.order.len() > bound {
            self.compact(s);
        }
    }

    fn holds(&self, s: u16, seq: SequenceHash) -> bool {
        self.holders(seq)
            .is_some_and(|h| h.as_slice().iter().any(|h| h.rank == s))
    }

    /// Drops the oldest pair slot `s` still holds; false when it holds none.
    fn evict_oldest(&mut self, s: u16) -> bool {
        loop {
            let next = Self::slot_mut(&mut self.ranks, s).order.pop_front();
            let Some((seq, engine)) = next else {
                return false;
            };
            if self.drop_pair(s, seq) {
                let slot = Self::slot_mut(&mut self.ranks, s);
                slot.blocks -= 1;
                if slot.engine.get(&engine) == Some(&seq) {
                    slot.engine.remove(&engine);
                }
                self.stats.evicted += 1;
                return true;
            }
        }
    }

    /// Removes slot `s` from the holders of `seq` (every tier); false if it was not one.
    fn drop_pair(&mut self, s: u16, seq: SequenceHash) -> bool {
        let Some(word) = self.blocks.get_mut(seq.0) else {
            return false;
        };
        match Holders::unpack(*word) {
            Holders::One(h) if h.rank == s => {
                self.blocks.remove(seq.0);
                true
            }
            Holders::One(_) => false,
            Holders::Spill(i) => {
                let list = &mut self.spill[i as usize];
                let Ok(pos) = super::holders::find(list, s) else {
                    return false;
                };
                list.remove(pos);
                self.spill_fp[i as usize] = super::fingerprint(list);
                if let [only] = list.as_slice() {
                    *word = Holders::One(*only).pack();
                    Self::free_spill(&mut self.spill, &mut self.spill_free, i);
                }
                true
            }
        }
    }

    /// Keeps one entry per pair slot `s` still holds, in order.
    fn compact(&mut self, s: u16) {
        let mut order = std::mem::take(&mut Self::slot_mut(&mut self.ranks, s).order);
        let mut seen = HashSet::with_capacity_and_hasher(order.len(), self.build);
        order.retain(|&(seq, _)| self.holds(s, seq) && seen.insert(seq));
        Self::slot_mut(&mut self.ranks, s).order = order;
    }
}
