//! Rank-level selection and booking: what the HTTP selection and slot-tracker services call
//! (Dynamo's API works on worker ranks, not endpoints). Same cost model, slot tracker and booking
//! rules as the endpoint-level pick in [`super`].

// The rank-level half of `KvState`: its helpers and types are this module's too.
use super::*;

/// One rank's standing for one request in a rank-level selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankChoice {
    pub rank: WorkerRank,
    /// Cached prefix on the rank, in blocks (KV-event index).
    pub overlap: Overlap,
    pub cost: f64,
    /// Prompt tokens the rank still has to prefill given its cache (what a reservation books).
    pub effective_prefill_tokens: u64,
    pub load: CandidateLoad,
}

/// Why a rank-level selection or reservation failed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SelectError {
    #[error("no schedulable worker")]
    NoCandidates,
    #[error(transparent)]
    Slot(#[from] crate::slots::SlotError),
}

/// Rank-level operations: what the HTTP selection and slot-tracker services call. They share the
/// cost model and the slot tracker with the endpoint-level [`KvState::rank`]/[`KvState::book`].
impl KvState {
    /// Cached prefix of `hashes` per rank in the KV-event index (only ranks holding its first
    /// block).
    pub fn rank_overlaps(&self, hashes: &[SequenceHash]) -> Vec<RankOverlap> {
        let (pool, mut sc) = self.take_scratch(hashes.len());
        self.event_matches(hashes, &mut sc);
        let found = sc.found.clone();
        self.return_scratch(pool, sc);
        found
    }

    /// Chooses among `ranks` with the KV-aware cost (ties: fewer active requests, then at random)
    /// and, when `reserve` names a request, books it on the chosen rank atomically: only if the
    /// rank's load is still the one the choice read (else it chooses again; the last of
    /// [`BOOKING_ATTEMPTS`] tries reads and books under one write lock). `found` is
    /// [`KvState::rank_overlaps`] of `hashes` (the caller keeps it for its own report). The ranks
    /// must be registered.
    pub fn select_rank(
        &self,
        ranks: &[WorkerRank],
        hashes: &[SequenceHash],
        found: &[RankOverlap],
        isl_tokens: u64,
        reserve: Option<(&str, Instant)>,
        rng: &mut fastrand::Rng,
    ) -> Result<RankChoice, SelectError> {
        if ranks.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let Some((id, now)) = reserve else {
            return Ok(self
                .choose_rank(&read(&self.slots), ranks, hashes, found, isl_tokens, rng)
                .0);
        };
        for _ in 1..BOOKING_ATTEMPTS {
            let (choice, version) =
                self.choose_rank(&read(&self.slots), ranks, hashes, found, isl_tokens, rng);
            let booked = write(&self.slots).add_if_unchanged(
                id,
                choice.rank,
                hashes,
                choice.effective_prefill_tokens,
                now,
                Some(version.unwrap_or(0)),
            )?;
            if booked {
                return Ok(choice);
            }
            self.booking_conflicts.fetch_add(1, Ordering::Relaxed);
        }
        let mut slots = write(&self.slots);
        let (choice, _) = self.choose_rank(&slots, ranks, hashes, found, isl_tokens, rng);
        slots.add(
            id,
            choice.rank,
            hashes,
            choice.effective_prefill_tokens,
            now,
        )?;
        Ok(choice)
    }

    /// The cheapest of `ranks` in `slots`, with its load version.
    fn choose_rank(
        &self,
        slots: &SlotTracker,
        ranks: &[WorkerRank],
        hashes: &[SequenceHash],
        found: &[RankOverlap],
        isl_tokens: u64,
        rng: &mut fastrand::Rng,
    ) -> (RankChoice, Option<u64>) {
        let overlap_of = |r: WorkerRank| {
            found
                .iter()
                .find(|o| o.rank == r)
                .map_or(Overlap::default(), |o| o.overlap)
        };
        let w = &self.settings.weights;
        let bs = self.block_size();
        let projected = slots.projections(ranks.iter().copied(), hashes, isl_tokens);
        let loads: Vec<CandidateLoad> = ranks
            .iter()
            .zip(&projected)
            .map(|(&r, (l, _))| CandidateLoad {
                overlap: overlap_of(r),
                potential_prefill_tokens: l.potential_prefill_tokens,
                potential_decode_blocks: l.potential_decode_blocks,
                active_requests: l.active_requests,
            })
            .collect();
        let costs: Vec<f64> = loads.iter().map(|c| w.cost(bs, c)).collect();
        let best = w.choose_with_tiebreak(&costs, |i| loads[i].active_requests, rng);
        let c = loads[best];
        let choice = RankChoice {
            rank: ranks[best],
            overlap: c.overlap,
            cost: costs[best],
            effective_prefill_tokens: w.effective_prefill_tokens(isl_tokens, bs, c.overlap),
            load: c,
        };
        (choice, projected[best].1)
    }

    /// Each rank's load if it took this request (unregistered ranks count as idle).
    pub fn potential_loads(
        &self,
        ranks: &[WorkerRank],
        hashes: &[SequenceHash],
        isl_tokens: u64,
    ) -> Vec<crate::slots::PotentialLoad> {
        read(&self.slots)
            .projections(ranks.iter().copied(), hashes, isl_tokens)
            .into_iter()
            .map(|(l, _)| l)
            .collect()
    }

    /// Makes a rank schedulable in the slot tracker (idempotent).
    pub fn register_rank(&self, rank: WorkerRank) {
        write(&self.slots).register(rank);
    }

    /// Removes a worker's ranks, active requests and cached blocks.
    pub fn remove_worker(&self, worker: u64) {
        self.remove_workers(&[worker]);
    }

    /// [`Self::remove_worker`] for several at once (one write of each index).
    pub(super) fn remove_workers(&self, workers: &[u64]) {
        if workers.is_empty() {
            return;
        }
        self.index.write(|ix| {
            for &w in workers {
                ix.remove_worker(w);
            }
        });
        self.approx.forget(workers);
        let mut slots = write(&self.slots);
        for &w in workers {
            slots.unregister_worker(w);
        }
    }

    /// Books a request on a registered rank until [`KvState::free`].
    pub fn reserve(
        &self,
        id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
        now: Instant,
    ) -> Result<(), crate::slots::SlotError> {
        write(&self.slots).add(id, rank, hashes, prefill_tokens, now)
    }

    pub fn prefill_complete(&self, id: &str) -> Result<(), crate::slots::SlotError> {
        write(&self.slots).prefill_complete(id)
    }

    pub fn output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), crate::slots::SlotError> {
        write(&self.slots).add_output_block(id, decay_fraction)
    }

    /// Releases a reservation; whether it was active.
    pub fn free(&self, id: &str) -> bool {
        write(&self.slots).free(id)
    }

    pub fn is_active(&self, id: &str) -> bool {
        read(&self.slots).is_active(id)
    }

    /// Requests booked in the slot tracker.
    pub fn active_count(&self) -> usize {
        read(&self.slots).active_count()
    }

    /// Every registered rank's load.
    pub fn rank_loads(&self) -> Vec<(WorkerRank, crate::slots::RankLoad)> {
        read(&self.slots).loads().collect()
    }

    /// Requests the slot tracker holds on `worker`'s rank 0 (the rank the picker books):
    /// this process's bookings and, with replica sync, its peers'. None: not registered.
    pub fn worker_requests(&self, worker: u64) -> Option<u32> {
        let rank = WorkerRank { worker, dp_rank: 0 };
        read(&self.slots).load(rank).map(|l| l.active_requests)
    }
}
