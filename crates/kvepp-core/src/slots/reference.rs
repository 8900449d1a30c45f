//! The slot tracker's simple reference, for the tests: the module's semantics owned by one caller
//! (`&mut self`, one trie, one map of requests), which [`super::SharedSlots`] is tested against.

use super::active::ActiveTrie;
use super::*;
use crate::types::DEFAULT_TABLE_SEED;

#[derive(Debug)]
pub struct SlotTracker {
    /// Dense rank states; a rank's id is its position (`None`: a freed id).
    ranks: Vec<Option<RankState>>,
    ids: Map<WorkerRank, u32>,
    free_ids: Vec<u32>,
    requests: HashMap<Arc<str>, Active>,
    /// Every active request's prompt blocks (see the module documentation).
    active: ActiveTrie,
    stale_after: Duration,
}

impl Default for SlotTracker {
    fn default() -> Self {
        SlotTracker::new(STALE_REQUEST_AFTER)
    }
}

impl SlotTracker {
    pub fn new(stale_after: Duration) -> Self {
        Self::with_seed(stale_after, DEFAULT_TABLE_SEED)
    }

    /// A tracker whose block tables are keyed by `seed` (pass a random one where hashes come
    /// from untrusted clients).
    pub fn with_seed(stale_after: Duration, seed: u64) -> Self {
        SlotTracker {
            ranks: Vec::new(),
            ids: HashMap::with_hasher(KeyedBuild::with_key(seed)),
            free_ids: Vec::new(),
            requests: HashMap::new(),
            active: ActiveTrie::with_seed(seed),
            stale_after,
        }
    }

    fn state(&self, rank: WorkerRank) -> Option<&RankState> {
        let id = *self.ids.get(&rank)?;
        self.ranks.get(id as usize)?.as_ref()
    }

    /// Makes a rank schedulable (idempotent).
    pub fn register(&mut self, rank: WorkerRank) {
        if self.ids.contains_key(&rank) {
            return;
        }
        let state = RankState::new(rank);
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.ranks[id as usize] = Some(state);
                id
            }
            None => {
                self.ranks.push(Some(state));
                (self.ranks.len() - 1) as u32
            }
        };
        self.ids.insert(rank, id);
    }

    /// Removes every rank of `worker` and its active requests.
    pub fn unregister_worker(&mut self, worker: u64) {
        let gone: Vec<u32> = self
            .ids
            .iter()
            .filter(|(r, _)| r.worker == worker)
            .map(|(_, &id)| id)
            .collect();
        if gone.is_empty() {
            return;
        }
        for &id in &gone {
            if let Some(state) = self.ranks[id as usize].take() {
                self.ids.remove(&state.id);
            }
            self.free_ids.push(id);
        }
        let mut dropped = Vec::new();
        self.requests.retain(|_, a| {
            let keep = !gone.contains(&a.rank);
            if !keep {
                dropped.push((a.rank, a.end));
            }
            keep
        });
        for (rank, end) in dropped {
            self.active.remove(rank, end);
        }
    }

    pub fn ranks(&self) -> impl Iterator<Item = WorkerRank> + '_ {
        self.ranks.iter().flatten().map(|s| s.id)
    }

    /// Every registered rank with its current load (unordered).
    pub fn loads(&self) -> impl Iterator<Item = (WorkerRank, RankLoad)> + '_ {
        self.ranks.iter().flatten().map(|s| (s.id, s.load()))
    }

    /// Whether `request_id` is active.
    pub fn is_active(&self, request_id: &str) -> bool {
        self.requests.contains_key(request_id)
    }

    /// Number of active requests.
    pub fn active_count(&self) -> usize {
        self.requests.len()
    }

    /// Books a request's prompt blocks and prefill tokens on `rank`.
    pub fn add(
        &mut self,
        request_id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
        now: Instant,
    ) -> Result<(), SlotError> {
        self.add_if_unchanged(request_id, rank, hashes, new_isl_tokens, now, None)
            .map(|_| ())
    }

    /// [`Self::add`], but only if the rank's load version (it changes with every booking, release or
    /// load update there) is still `expected` (when given):
    /// a pick books the load it read or nothing. Ok(false): the load changed, nothing booked.
    pub fn add_if_unchanged(
        &mut self,
        request_id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
        now: Instant,
        expected: Option<u64>,
    ) -> Result<bool, SlotError> {
        let booking = NewRequest {
            id: request_id.into(),
            hashes: Arc::from(hashes),
            new_isl_tokens,
            now,
        };
        self.add_booking(booking, rank, expected)
    }

    /// [`Self::add_if_unchanged`] of a booking whose id and hash list are already owned (what
    /// [`SharedSlots::add_booking`] takes, so the differential test books both alike).
    pub fn add_booking(
        &mut self,
        booking: NewRequest,
        rank: WorkerRank,
        expected: Option<u64>,
    ) -> Result<bool, SlotError> {
        if self.requests.contains_key(&booking.id) {
            return Err(SlotError::DuplicateRequest(booking.id.to_string()));
        }
        let id = *self.ids.get(&rank).ok_or(SlotError::UnknownRank(rank))?;
        let Some(state) = self.ranks[id as usize].as_mut() else {
            return Err(SlotError::UnknownRank(rank));
        };
        if expected.is_some_and(|v| v != state.version) {
            return Ok(false);
        }
        // Only the blocks new to the rank count; the list is shared by the trie, not copied.
        let (end, added) = self.active.insert(id, &booking.hashes);
        state.take(booking.new_isl_tokens, added);
        let active = Active {
            rank: id,
            shard: 0,
            end,
            prefill_tokens: booking.new_isl_tokens,
            output_blocks: 0.0,
            added: booking.now,
        };
        self.requests.insert(booking.id, active);
        Ok(true)
    }

    /// The request's first output token exists: its prefill tokens no longer load the rank.
    /// Repeating it is a no-op.
    pub fn prefill_complete(&mut self, request_id: &str) -> Result<(), SlotError> {
        let active = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.to_owned()))?;
        let tokens = std::mem::take(&mut active.prefill_tokens);
        let id = active.rank;
        if let Some(state) = self.ranks[id as usize].as_mut() {
            state.prefill_done(tokens);
        }
        Ok(())
    }

    /// The request produced another block of output: it adds `decay_fraction` (default 1, clamped
    /// to [0, 1]) of a block to its rank's decode load until the request ends.
    pub fn add_output_block(
        &mut self,
        request_id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), SlotError> {
        let active = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.to_owned()))?;
        let w = output_weight(decay_fraction);
        active.output_blocks += w;
        let id = active.rank;
        if let Some(state) = self.ranks[id as usize].as_mut() {
            state.output(w);
        }
        Ok(())
    }

    /// Releases everything the request holds. Idempotent; returns whether it was active.
    pub fn free(&mut self, request_id: &str) -> bool {
        let Some(active) = self.requests.remove(request_id) else {
            return false;
        };
        Self::release(&mut self.ranks, &mut self.active, active);
        true
    }

    fn release(ranks: &mut [Option<RankState>], trie: &mut ActiveTrie, active: Active) {
        let Some(state) = ranks[active.rank as usize].as_mut() else {
            return;
        };
        let freed = trie.remove(active.rank, active.end);
        state.give_back(&active, freed);
    }

    /// Drops requests older than the stale limit; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let stale: Vec<Arc<str>> = self
            .requests
            .iter()
            .filter(|(_, a)| now.saturating_duration_since(a.added) > self.stale_after)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            if let Some(active) = self.requests.remove(id) {
                let rank = self.ranks[active.rank as usize].as_ref().map(|s| s.id);
                tracing::warn!(request = ?id, worker = rank.map(|r| r.worker), dp_rank = rank.map(|r| r.dp_rank), "stale request expired from load accounting");
                Self::release(&mut self.ranks, &mut self.active, active);
            }
        }
        stale.len()
    }

    pub fn load(&self, rank: WorkerRank) -> Option<RankLoad> {
        self.state(rank).map(RankState::load)
    }

    /// How many leading blocks of `hashes` every rank has active: one walk down the active
    /// requests' trie into `scratch`; [`SharedSlots::project`] reads it.
    pub fn walk_held(&self, hashes: &[SequenceHash], scratch: &mut HeldScratch) {
        self.active.walk(hashes, scratch, self.ranks.len());
    }

    /// After [`Self::walk_held`] with `scratch`: how many leading blocks `rank` has active.
    fn held_in(&self, scratch: &HeldScratch, rank: WorkerRank) -> u64 {
        self.ids
            .get(&rank)
            .map_or(0, |&id| scratch.get(id as usize))
    }

    /// A rank's load if it took a request of `blocks` prompt blocks whose first `held` it has
    /// active ([`Self::walk_held`]) and `new_isl_tokens` to prefill, with the rank's version
    /// (an unknown rank counts as idle, version None).
    pub fn projection(
        &self,
        rank: WorkerRank,
        blocks: u64,
        held: u64,
        new_isl_tokens: u64,
    ) -> (PotentialLoad, Option<u64>) {
        let view = self.state(rank).map(RankState::view);
        RankView::projected(view, rank, blocks, held, new_isl_tokens)
    }

    /// Each of `ranks`' load if it took a request with these prompt blocks and prefill tokens
    /// (blocks it already has active count once; an unknown rank counts as idle), with its
    /// version: one walk over the active blocks for all of them.
    pub fn projections(
        &self,
        ranks: impl IntoIterator<Item = WorkerRank>,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
    ) -> Vec<(PotentialLoad, Option<u64>)> {
        let mut held = HeldScratch::default();
        self.walk_held(hashes, &mut held);
        ranks
            .into_iter()
            .map(|r| {
                let h = self.held_in(&held, r);
                self.projection(r, hashes.len() as u64, h, new_isl_tokens)
            })
            .collect()
    }

    /// One rank's load if it took a request with these prompt blocks and prefill tokens (an
    /// unknown rank counts as idle).
    pub fn potential_load(
        &self,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
    ) -> PotentialLoad {
        let mut held = HeldScratch::default();
        self.walk_held(hashes, &mut held);
        let held = self.held_in(&held, rank);
        self.projection(rank, hashes.len() as u64, held, new_isl_tokens)
            .0
    }

    /// Every rank's load if it took a request with these prompt blocks and prefill tokens. Blocks
    /// the rank already has active count once.
    pub fn potential_loads(
        &self,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
    ) -> Vec<PotentialLoad> {
        self.projections(self.ranks(), hashes, new_isl_tokens)
            .into_iter()
            .map(|(l, _)| l)
            .collect()
    }
}
