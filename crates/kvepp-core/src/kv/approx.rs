//! Approximate mode's memory of what was routed where (see [`Approx`]).
//!
//! Invariants: at most `cap` references per endpoint, the oldest evicted first (before new blocks
//! are stored); a forgotten endpoint leaves nothing behind. An endpoint's FIFO and its entries in
//! the index change together under its FIFO shard's lock (one of `FIFO_SHARDS`, by worker id), so
//! recordings for endpoints in different shards wait only for the index's writer, never for one
//! global lock.

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};

use super::PromptBlocks;
use crate::hash::SequenceHash;
use crate::index::{EngineBlockHash, SharedIndex, Tier};
use crate::types::WorkerRank;

/// Blocks we routed, per endpoint, for approximate mode: a FIFO of references per endpoint in a
/// prefix index. Only the blocks beyond the prefix the endpoint already held get references, so a
/// prompt routed again costs what it adds; a hot prefix ages out after `cap` newer blocks and is
/// recorded again by the next request that routes it.
#[derive(Debug)]
pub(super) struct Approx {
    pub(super) index: SharedIndex,
    fifos: Box<[Mutex<Fifos>]>,
    pub(super) cap: usize,
}

type Fifos = HashMap<u64, VecDeque<SequenceHash>>;

const FIFO_SHARDS: usize = 16;

impl Approx {
    pub(super) fn new(index: SharedIndex, cap: usize) -> Self {
        Approx {
            index,
            fifos: (0..FIFO_SHARDS).map(|_| Mutex::default()).collect(),
            cap,
        }
    }

    fn shard(&self, worker: u64) -> &Mutex<Fifos> {
        // Worker ids are hashes of addresses already: their low bits spread.
        &self.fifos[(worker % FIFO_SHARDS as u64) as usize]
    }

    /// `worker`'s FIFO, oldest first (tests).
    #[cfg(test)]
    pub(super) fn fifo_of(&self, worker: u64) -> Vec<SequenceHash> {
        let fifos = self.shard(worker).lock();
        fifos
            .get(&worker)
            .map_or_else(Vec::new, |f| f.iter().copied().collect())
    }

    /// The workers with routed blocks on record.
    pub(super) fn workers(&self) -> Vec<u64> {
        self.fifos
            .iter()
            .flat_map(|f| f.lock().keys().copied().collect::<Vec<_>>())
            .collect()
    }

    /// Records `p`'s leading blocks (at most `cap`) after the first `held` as routed to `worker`,
    /// first evicting the oldest references so they fit: the rank's distinct blocks never exceed
    /// its references, so the index always has room and the FIFO keeps learning under pressure.
    pub(super) fn record(&self, worker: u64, p: &PromptBlocks, held: usize) {
        let rank = WorkerRank { worker, dp_rank: 0 };
        let n = p.hashes.len().min(self.cap);
        let skip = held.min(n);
        if skip == n {
            // Everything is there already: no write, so readers and other writers never wait.
            return;
        }
        let mut fifos = self.shard(worker).lock();
        let fifo = fifos.entry(worker).or_default();
        let evict = (fifo.len() + n - skip)
            .saturating_sub(self.cap)
            .min(fifo.len());
        let evicted: Vec<SequenceHash> = fifo.drain(..evict).collect();
        let parent = skip.checked_sub(1).map(|i| EngineBlockHash(p.hashes[i].0));
        let blocks: Vec<(EngineBlockHash, _)> = p.hashes[skip..n]
            .iter()
            .zip(&p.locals[skip..n])
            .map(|(s, l)| (EngineBlockHash(s.0), *l))
            .collect();
        // Published without waiting for the readers of the copy just left (a booking must not
        // wait for picks under way), which owes the change until the next write.
        let stored = self.index.write_owned(move |ix| {
            ix.remove(
                rank,
                Tier::Device,
                evicted.iter().map(|h| EngineBlockHash(h.0)),
            );
            // Cannot be full after the eviction above. A refusal (full, or the held prefix
            // evicted meanwhile by another record) only loses this request's blocks, never leaks
            // index entries outside the FIFO.
            ix.store(rank, Tier::Device, parent, blocks.iter().copied())
                .unwrap_or(0)
        });
        fifo.extend(p.hashes[skip..skip + stored].iter().copied());
    }

    /// How many leading blocks of `p` the approximate index holds for `worker`.
    pub(super) fn held(&self, worker: u64, p: &PromptBlocks) -> usize {
        self.index
            .read()
            .overlaps(&p.hashes)
            .iter()
            .find(|o| o.rank.worker == worker && o.rank.dp_rank == 0)
            .map_or(0, |o| o.overlap.device as usize)
    }

    /// Forgets `workers`' routed blocks (index and FIFOs together).
    pub(super) fn forget(&self, workers: &[u64]) {
        // Every shard, in order (the only place more than one is held): no recording of these
        // workers runs between the index's removal and the FIFOs'.
        let mut fifos: Vec<_> = self.fifos.iter().map(|f| f.lock()).collect();
        self.index.write(|ix| {
            for &w in workers {
                ix.remove_worker(w);
            }
        });
        for f in &mut fifos {
            f.retain(|w, _| !workers.contains(w));
        }
    }
}
