//! The rank-level side of the state, as Dynamo's API sees it (worker ranks, not endpoints): what
//! the HTTP selection and slot-tracker services read (overlaps per rank, loads, projections), the
//! ranks' registration, and the slot-tracker entries of bookings this process did not decide (a
//! peer replica's, applied by replica sync, or the slot-tracker service's), recorded and freed by
//! id without telling the hub. Selection and reservation are not here: they go through the
//! router's one transaction over rank-level candidates ([`crate::Endpoint::for_rank`]).

// The rank-level half of `KvState`: its helpers and types are this module's too.
use super::*;

/// Rank-level operations: inspection, and records of bookings decided elsewhere.
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

    /// Each rank's load if it took this request (unregistered ranks count as idle).
    pub fn potential_loads(
        &self,
        ranks: &[WorkerRank],
        hashes: &[SequenceHash],
        isl_tokens: u64,
    ) -> Vec<crate::slots::PotentialLoad> {
        self.slots
            .projections(ranks.iter().copied(), hashes, isl_tokens)
            .into_iter()
            .map(|(l, _)| l)
            .collect()
    }

    /// Makes a rank schedulable in the slot tracker (idempotent).
    pub fn register_rank(&self, rank: WorkerRank) {
        self.slots.register(rank);
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
        self.slots.unregister_workers(workers);
        for &w in workers {
            self.fallback.forget(w);
        }
    }

    /// Records a booking decided elsewhere (a peer replica's) on a registered rank, until
    /// [`KvState::free`]. Not told to the hub: it is someone else's.
    pub fn reserve(
        &self,
        id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
        now: Instant,
    ) -> Result<(), crate::slots::SlotError> {
        self.slots.add(id, rank, hashes, prefill_tokens, now)
    }

    pub fn prefill_complete(&self, id: &str) -> Result<(), crate::slots::SlotError> {
        self.slots.prefill_complete(id)
    }

    pub fn output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), crate::slots::SlotError> {
        self.slots.add_output_block(id, decay_fraction)
    }

    /// Releases a reservation; whether it was active.
    pub fn free(&self, id: &str) -> bool {
        self.slots.free(id)
    }

    pub fn is_active(&self, id: &str) -> bool {
        self.slots.is_active(id)
    }

    /// Requests booked in the slot tracker.
    pub fn active_count(&self) -> usize {
        self.slots.active_count()
    }

    /// Every registered rank's load.
    pub fn rank_loads(&self) -> Vec<(WorkerRank, crate::slots::RankLoad)> {
        self.slots.loads()
    }

    /// Requests the slot tracker holds on `worker`'s rank 0 (the rank the picker books):
    /// this process's bookings and, with replica sync, its peers'. None: not registered.
    pub fn worker_requests(&self, worker: u64) -> Option<u32> {
        let rank = WorkerRank { worker, dp_rank: 0 };
        self.slots.load(rank).map(|l| l.active_requests)
    }
}
