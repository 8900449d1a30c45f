//! Active-request load per (worker, data-parallel rank), with the slot-tracker semantics of Dynamo:
//! what the cost model reads and what a pick books.
//!
//! Invariants:
//! - `active_decode_blocks` of a rank is the number of distinct prompt sequence hashes of its active
//!   requests: shared prefixes count once (reference-counted);
//! - `active_prefill_tokens` is the sum of `new_isl_tokens` of its active requests whose prefill has
//!   not completed;
//! - every request is counted on exactly one rank until freed, its rank is unregistered, or it is
//!   older than the stale-request limit (300 s by default);
//! - a rank's `version` changes whenever its load changes, so a pick can book exactly the load it
//!   read ([`SharedSlots::add_booking`] with the version it read).
//!
//! Layout, for picks over thousands of ranks: ranks live in a dense array (a small id per rank);
//! the active requests' prompts live in one trie (`active`), whose nodes count each rank's
//! requests through them. A projection ([`SharedSlots::walk_held`]) is one walk down the trie along
//! the prompt, writing how far each rank on the path holds it into a dense scratch array (no
//! ranks × blocks); booking and releasing a request touch one count per node on its path and
//! compare hashes along it, never a table entry per block.
//!
//! [`SharedSlots`] (the `shared` module) is the tracker the routing core uses: these semantics
//! without one lock over the whole of it. The tests hold it to `reference::SlotTracker`, the
//! same semantics owned by one caller (`&mut self`), compiled only for them.
//! [`SharedSlots`] also keeps its ranks in load-key order (the `order` module, [`KeyParams`]), so
//! a pick under Dynamo's cost finds the least loaded without reading every rank.
//!
//! The clock is passed in, so nothing here sleeps or reads time.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::hash::SequenceHash;
use crate::types::KeyedBuild;
pub use crate::types::WorkerRank;

mod active;
mod order;
mod shared;

pub use active::HeldScratch;
pub use order::{KeyParams, KeyReader, VisitScratch};
pub use shared::SharedSlots;

/// Requests older than this are dropped by [`SharedSlots::expire`] (Dynamo's default).
pub const STALE_REQUEST_AFTER: Duration = Duration::from_secs(300);

/// The current load of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    pub active_requests: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// What a rank's load would be with one more request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PotentialLoad {
    pub rank: WorkerRank,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u32,
}

/// A rank's load as a pick reads it: load and version ([`SharedSlots`] publishes one per rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankView {
    /// The rank's worker and data-parallel rank + 1 (0: a free dense id), apart rather than an
    /// `Option<WorkerRank>`: 40 bytes a view instead of 56, for the copy every pick makes.
    worker: u64,
    dp_rank_plus_one: u32,
    active_requests: u32,
    version: u64,
    prefill_tokens: u64,
    decode_blocks: u64,
}

impl RankView {
    /// Whether this is `rank`'s view (never a free id's; a data-parallel rank of `u32::MAX`
    /// never matches, and is read from the tracker's states instead).
    fn is(&self, rank: WorkerRank) -> bool {
        self.dp_rank_plus_one != 0
            && self.worker == rank.worker
            && self.dp_rank_plus_one == rank.dp_rank.wrapping_add(1)
    }

    /// The rank's load with a request of `blocks` prompt blocks whose first `held` it already has
    /// active, and `new_isl_tokens` to prefill (the default view is an idle rank).
    fn potential(
        &self,
        rank: WorkerRank,
        blocks: u64,
        held: u64,
        new_isl_tokens: u64,
    ) -> PotentialLoad {
        PotentialLoad {
            rank,
            potential_prefill_tokens: self.prefill_tokens + new_isl_tokens,
            potential_decode_blocks: self.decode_blocks + blocks.saturating_sub(held),
            active_requests: self.active_requests,
        }
    }

    /// [`Self::potential`] of a rank's view with its version; without one (an unknown rank) the
    /// rank counts as idle, holding nothing, version None. Both trackers' projections.
    fn projected(
        view: Option<RankView>,
        rank: WorkerRank,
        blocks: u64,
        held: u64,
        new_isl_tokens: u64,
    ) -> (PotentialLoad, Option<u64>) {
        match view {
            Some(v) => (
                v.potential(rank, blocks, held, new_isl_tokens),
                Some(v.version),
            ),
            None => (
                RankView::default().potential(rank, blocks, 0, new_isl_tokens),
                None,
            ),
        }
    }
}

/// A request to book, owned: its id, its prompt's hash list (shared with the active requests'
/// trie as it is), prefill tokens and time ([`SharedSlots::add_booking`]).
#[derive(Debug, Clone)]
pub struct NewRequest {
    pub id: Arc<str>,
    pub hashes: Arc<[SequenceHash]>,
    pub new_isl_tokens: u64,
    pub now: Instant,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlotError {
    #[error("worker {} rank {} is not registered", .0.worker, .0.dp_rank)]
    UnknownRank(WorkerRank),
    #[error("request {0:?} is already active")]
    DuplicateRequest(String),
    #[error("request {0:?} is not active")]
    UnknownRequest(String),
}

type Map<K, V> = HashMap<K, V, KeyedBuild>;

#[derive(Debug)]
struct RankState {
    id: WorkerRank,
    active_requests: u32,
    prefill_tokens: u64,
    /// Distinct active prompt blocks (the lengths of the trie nodes the rank is present in).
    blocks: u64,
    /// Output blocks of active requests, each weighted by its decay fraction.
    output_blocks: f64,
    version: u64,
}

impl RankState {
    fn new(id: WorkerRank) -> Self {
        RankState {
            id,
            active_requests: 0,
            prefill_tokens: 0,
            blocks: 0,
            output_blocks: 0.0,
            version: 0,
        }
    }

    /// Prompt blocks (distinct) plus weighted output blocks, rounded.
    fn decode_blocks(&self) -> u64 {
        let output = if self.output_blocks > 0.0 {
            self.output_blocks.round() as u64
        } else {
            0
        };
        self.blocks + output
    }

    fn load(&self) -> RankLoad {
        RankLoad {
            active_requests: self.active_requests,
            active_prefill_tokens: self.prefill_tokens,
            active_decode_blocks: self.decode_blocks(),
        }
    }

    /// Its load as a pick reads it.
    fn view(&self) -> RankView {
        RankView {
            worker: self.id.worker,
            dp_rank_plus_one: self.id.dp_rank.wrapping_add(1),
            version: self.version,
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.decode_blocks(),
            active_requests: self.active_requests,
        }
    }

    /// A request booked here: `tokens` to prefill, `added` prompt blocks new to the rank.
    fn take(&mut self, tokens: u64, added: u64) {
        self.version += 1;
        self.active_requests += 1;
        self.prefill_tokens += tokens;
        self.blocks += added;
    }

    /// A request of this rank left, with what it still held; `freed` prompt blocks no other
    /// request here holds.
    fn give_back(&mut self, active: &Active, freed: u64) {
        self.version += 1;
        self.active_requests -= 1;
        self.prefill_tokens -= active.prefill_tokens;
        self.output_blocks -= active.output_blocks;
        if self.active_requests == 0 {
            self.output_blocks = 0.0; // no float drift once idle
        }
        debug_assert!(freed <= self.blocks, "a rank frees only blocks it counted");
        self.blocks = self.blocks.saturating_sub(freed);
        debug_assert!(self.active_requests > 0 || self.blocks == 0);
    }

    /// A request's prefill (`tokens` of it still counted) completed.
    fn prefill_done(&mut self, tokens: u64) {
        self.prefill_tokens -= tokens;
        self.version += 1;
    }

    /// A request produced an output block of weight `w`.
    fn output(&mut self, w: f64) {
        self.output_blocks += w;
        self.version += 1;
    }
}

/// An output block's weight: `decay_fraction` clamped to [0, 1], 1 when absent or not finite.
fn output_weight(decay_fraction: Option<f64>) -> f64 {
    match decay_fraction {
        Some(w) if w.is_finite() => w.clamp(0.0, 1.0),
        Some(_) | None => 1.0,
    }
}

#[derive(Debug)]
struct Active {
    rank: u32,
    /// The trie shard its path is in ([`SharedSlots`]; 0 in the test reference's one trie).
    shard: u16,
    /// The trie node its prompt's path ends at.
    end: u32,
    /// Tokens still in prefill (0 once prefill completed).
    prefill_tokens: u64,
    /// Sum of this request's output-block weights.
    output_blocks: f64,
    added: Instant,
}

#[cfg(test)]
mod reference;
#[cfg(test)]
pub(crate) use reference::SlotTracker;

#[cfg(test)]
mod tests;
