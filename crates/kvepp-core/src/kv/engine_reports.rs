//! What engines report of themselves, and how the state follows it: each worker's block size
//! (the pool's is the configured one, or the one most engines report; an engine of another size
//! is matched by what is routed to it), each rank's KV capacity (the index's bound for it), the
//! base model (what tells an adapter from it), and whether a worker's KV events are read at all
//! (events that stop decoding put it in fallback until they decode again).

// The engine-reported half of `KvState`: its helpers and types are this module's too.
use super::*;

impl KvState {
    /// `worker`'s engine reported its block size (metrics page, metadata or KV events). Learned,
    /// the pool's block size is the one most engines report; configured, it stays. An engine
    /// reporting another size is in fallback ([`FallbackReason::BlockSize`]) while it does. When
    /// the pool's size changes, what was recorded as routed (approximate mode, fallback) goes:
    /// it was hashed at the old size.
    pub fn learn_block_size(&self, worker: u64, bs: u32) {
        if bs == 0 {
            return;
        }
        let configured = (!self.settings.learn_block_size).then_some(self.settings.block_size);
        let current = self.block_size();
        let pool = self
            .fallback
            .report_block_size(worker, bs, configured, current);
        if pool != current {
            self.block_size.store(pool, Ordering::Relaxed);
            // Routed prompts recorded at the old size match no prompt hashed at the new one.
            self.approx.forget(&self.approx.workers());
            tracing::info!(
                block_size = pool,
                previous = current,
                "block size learned from the engines (metrics page, metadata or KV events); routed prefixes recorded at the previous size dropped"
            );
        }
        if bs != pool {
            tracing::debug!(
                worker,
                block_size = bs,
                pool = pool,
                "an engine's block size differs from the pool's: matched by what is routed to it"
            );
        }
    }

    /// `worker`'s KV events stopped decoding (`on`), or decode again (`!on`). While on, a token
    /// prompt's cached prefix on it is what was routed to it (recorded at booking, FIFO-bounded
    /// as in approximate mode), not what the KV-event index says; picks read every candidate
    /// (no ordered shortcut). Returns whether the state changed.
    pub fn set_events_fallback(&self, worker: u64, on: bool) -> bool {
        self.fallback.set(worker, FallbackReason::Undecodable, on)
    }

    /// Whether `worker` is in fallback, for any reason ([`fallback`]).
    pub fn in_events_fallback(&self, worker: u64) -> bool {
        self.fallback.contains(worker)
    }

    /// An engine reported its base model name.
    pub fn learn_base_model(&self, name: &str) {
        let mut base = self.base_model.write();
        if base.as_deref() != Some(name) {
            tracing::info!(model = name, "base model learned from engine metadata");
            *base = Some(name.into());
        }
    }

    /// An engine reported the KV blocks `rank` has room for (`num_gpu_blocks` and any CPU tier,
    /// or `/metadata`'s `total_kv_blocks`): the index keeps at most that plus
    /// [`capacity_limit`]'s margin for the rank, dropping its oldest blocks beyond it.
    pub fn set_engine_capacity(&self, rank: WorkerRank, blocks: u64) {
        if blocks == 0 {
            return;
        }
        let limit = capacity_limit(blocks);
        if self.index.read().rank_limit(rank) == limit {
            return;
        }
        let dropped = self.index.write(|ix| ix.set_rank_limit(rank, limit));
        tracing::debug!(?rank, blocks, limit, dropped = ?dropped, "KV index bound set from the engine's capacity");
    }
}

/// The pairs the index keeps for a rank whose engine reports `blocks` of KV capacity: a quarter
/// more, plus 64, for events in flight and blocks the engine frees and reuses between two
/// removals' publications.
pub fn capacity_limit(blocks: u64) -> u64 {
    blocks.saturating_add(blocks / 4).saturating_add(64)
}
