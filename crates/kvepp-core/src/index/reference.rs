//! The simplest correct prefix index: a map of maps per rank, walked rank by rank. It defines what
//! [`super::PrefixIndex`] must compute; the differential test below drives both with the same random
//! event streams and compares every answer.

use std::collections::{HashMap, HashSet, VecDeque};

use super::{EngineBlockHash, IndexError, RankOverlap, Tier};
use crate::hash::{LocalBlockHash, SequenceHash};
use crate::types::{Overlap, WorkerRank};

#[derive(Debug, Default)]
struct RefRank {
    blocks: HashMap<SequenceHash, [u32; 3]>,
    engine: HashMap<EngineBlockHash, SequenceHash>,
    /// The bound's policy, as `super::bound` states it: new pairs in store order, the oldest
    /// held one dropped when a store would pass the limit, compacted past twice the pairs.
    order: VecDeque<(SequenceHash, EngineBlockHash)>,
    limit: Option<u64>,
}

impl RefRank {
    fn evict_oldest(&mut self) -> bool {
        while let Some((seq, engine)) = self.order.pop_front() {
            if self.blocks.remove(&seq).is_some() {
                if self.engine.get(&engine) == Some(&seq) {
                    self.engine.remove(&engine);
                }
                return true;
            }
        }
        false
    }

    fn note_new(&mut self, seq: SequenceHash, engine: EngineBlockHash) {
        self.order.push_back((seq, engine));
        if self.order.len() > self.blocks.len() * 2 + super::bound::SLACK {
            let mut seen = HashSet::new();
            let blocks = &self.blocks;
            self.order
                .retain(|(seq, _)| blocks.contains_key(seq) && seen.insert(*seq));
        }
    }
}

#[derive(Debug)]
pub struct ReferenceIndex {
    ranks: HashMap<WorkerRank, RefRank>,
    max_blocks_per_rank: u64,
}

impl ReferenceIndex {
    pub fn new(max_blocks_per_rank: u64) -> Self {
        ReferenceIndex {
            ranks: HashMap::new(),
            max_blocks_per_rank,
        }
    }

    /// See `PrefixIndex::set_rank_limit`.
    pub fn set_rank_limit(&mut self, rank: WorkerRank, limit: u64) -> u64 {
        let limit = limit.clamp(1, self.max_blocks_per_rank);
        let r = self.ranks.entry(rank).or_default();
        r.limit = Some(limit);
        let mut dropped = 0;
        while r.blocks.len() as u64 > limit && r.evict_oldest() {
            dropped += 1;
        }
        dropped
    }

    pub fn rank_blocks(&self, rank: WorkerRank) -> u64 {
        self.ranks.get(&rank).map_or(0, |r| r.blocks.len() as u64)
    }

    pub fn pair_count(&self) -> u64 {
        self.ranks.values().map(|r| r.blocks.len() as u64).sum()
    }

    pub fn store(
        &mut self,
        rank: WorkerRank,
        tier: Tier,
        parent: Option<EngineBlockHash>,
        blocks: impl IntoIterator<Item = (EngineBlockHash, LocalBlockHash)>,
    ) -> Result<usize, IndexError> {
        let r = self.ranks.entry(rank).or_default();
        let limit = r.limit.unwrap_or(self.max_blocks_per_rank);
        let mut prev = match parent {
            None => None,
            Some(p) => {
                let seq = r.engine.get(&p).copied().or_else(|| {
                    let own = SequenceHash(p.0);
                    r.blocks.contains_key(&own).then_some(own)
                });
                Some(seq.ok_or(IndexError::UnknownParent { rank, parent: p })?)
            }
        };
        let mut n = 0;
        for (engine, local) in blocks {
            let seq = SequenceHash::chain(prev, local);
            prev = Some(seq);
            let new = !r.blocks.contains_key(&seq);
            if new && r.blocks.len() as u64 >= limit {
                r.evict_oldest();
            }
            if new && r.blocks.len() as u64 >= limit {
                return Err(IndexError::RankFull { rank, limit });
            }
            let refs = r.blocks.entry(seq).or_default();
            refs[tier as usize] += 1;
            if new {
                r.note_new(seq, engine);
            }
            if engine.0 != seq.0 {
                r.engine.insert(engine, seq);
            }
            n += 1;
        }
        Ok(n)
    }

    pub fn remove(
        &mut self,
        rank: WorkerRank,
        tier: Tier,
        engine_hashes: impl IntoIterator<Item = EngineBlockHash>,
    ) -> usize {
        let Some(r) = self.ranks.get_mut(&rank) else {
            return 0;
        };
        let mut dropped = 0;
        for e in engine_hashes {
            let seq = r.engine.get(&e).copied().unwrap_or(SequenceHash(e.0));
            let Some(refs) = r.blocks.get_mut(&seq) else {
                continue;
            };
            if refs[tier as usize] == 0 {
                continue;
            }
            refs[tier as usize] -= 1;
            if *refs == [0; 3] {
                r.blocks.remove(&seq);
                r.engine.remove(&e);
                dropped += 1;
            }
        }
        dropped
    }

    pub fn clear_rank(&mut self, rank: WorkerRank) {
        if let Some(r) = self.ranks.get_mut(&rank) {
            *r = RefRank {
                limit: r.limit,
                ..RefRank::default()
            };
        }
    }

    pub fn remove_worker(&mut self, worker: u64) {
        self.ranks.retain(|r, _| r.worker != worker);
    }

    /// Every rank holding at least the first block, sorted by rank.
    pub fn overlaps(&self, hashes: &[SequenceHash]) -> Vec<RankOverlap> {
        let mut out: Vec<RankOverlap> = self
            .ranks
            .iter()
            .filter_map(|(&rank, r)| {
                let run = |held: &dyn Fn(&[u32; 3]) -> bool| {
                    hashes
                        .iter()
                        .take_while(|h| r.blocks.get(h).is_some_and(held))
                        .count() as u64
                };
                let overlap = Overlap {
                    device: run(&|c| c[0] > 0),
                    host: run(&|c| c[0] > 0 || c[1] > 0),
                    disk: run(&|_| true),
                };
                (overlap.disk > 0).then_some(RankOverlap { rank, overlap })
            })
            .collect();
        out.sort_by_key(|o| o.rank);
        out
    }
}
