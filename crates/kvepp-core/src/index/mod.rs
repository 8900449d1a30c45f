//! The prefix index: which worker rank holds which KV blocks, in which tier, and how long a prefix of
//! a request each rank already holds.
//!
//! Blocks are keyed by our own [`SequenceHash`]es (Dynamo's chain, computed from the tokens the
//! engines publish), so a request's hashes and an engine's blocks meet in one table. The engine's
//! own block hash is kept per rank only to resolve later removals and parents, and only when it
//! differs from ours (engines that publish Dynamo-compatible hashes cost nothing extra).
//!
//! Layout: one hash table from sequence hash to its holders. A block held by one rank (the common
//! case) stores that holder inline; a block held by more spills into a side list. Ranks are dense
//! `u16` slots, so a holder is 8 bytes: the slot and a reference count per tier.
//!
//! Invariants (checked against `reference::ReferenceIndex` by a differential test):
//! - a (block, rank) pair exists iff one of its tier reference counts is non-zero; duplicate stores
//!   add references, removals take them away, `AllBlocksCleared` drops the rank's pairs;
//! - a spilled holder list has at least two holders, never the same rank twice, in rank slot
//!   order (so a lookup of one rank in it is a binary search, `holders::find`);
//! - `blocks` of a rank is its number of pairs, and never exceeds the rank's limit (at most
//!   `max_blocks_per_rank`; [`PrefixIndex::set_rank_limit`] lowers it to what the engine reports):
//!   a store beyond it first drops the rank's oldest pair, counted (`bound`), so a publisher that
//!   never removes cannot grow memory past ranks × the limit;
//! - [`PrefixIndex::find_matches`] reports, per rank, the number of leading request blocks held on
//!   the device, on device or host, and anywhere (so device ≤ host ≤ disk), and only ranks with at
//!   least one leading block.
//!
//! - a spilled holder list's fingerprint (`holders::fingerprint`) is recomputed with every change to it,
//!   so the walk may treat consecutive blocks with equal fingerprints as held alike.
//!
//! Lookups: [`PrefixIndex::find_matches`] reads every block of the matched prefix (batched
//! probes); [`PrefixIndex::find_matches_jumping`] searches for the points where the holders
//! change, which is exact when each rank's blocks are prefix-closed per tier class (engines
//! evicting leaves first) and costs a few dozen probes per distinct holder set instead of one per
//! block. A walk leaves its runs in a [`MatchScratch`] indexed by rank slot; a caller reads one
//! rank's with [`PrefixIndex::walked`] (a remembered slot hint, checked against a dense array of
//! slot owners) or all of them with [`PrefixIndex::walked_all`].
//! [`PrefixIndex::walk_levels`] walks the same way but writes no run: it keeps the prompt's
//! levels (stretches held alike, with their holder lists, which are kept in slot order), and a
//! rank's run is read from them when asked for, a binary search per level; for picks that read
//! few of the holders of a widely held prefix ([`PrefixIndex::materialize`] writes the runs out
//! when many are read after all).
//!
//! Clearing a rank scans the table (rare: engine restarts and departures).

mod bound;
mod holders;
mod levels;
#[cfg(any(test, feature = "test-util"))]
#[doc(hidden)]
pub mod reference;
mod scratch;
mod shared;
mod table;
mod walk;

use self::holders::{fingerprint, Holder, HolderList, Holders};
pub use self::levels::LevelView;
pub use self::scratch::MatchScratch;
pub use self::shared::SharedIndex;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};

use self::table::BlockTable;
use crate::hash::{LocalBlockHash, SequenceHash};
pub use crate::types::{KeyedBuild, KeyedHasher, RankOverlap, DEFAULT_TABLE_SEED};
use crate::types::{Overlap, WorkerRank};

/// The engine's own block hash: only an opaque key to resolve later removals (vLLM's hash cannot be
/// recomputed outside the engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineBlockHash(pub u64);

/// Where a block lives: GPU memory, host memory, or anything slower (disk, remote, external).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    Device,
    Host,
    Disk,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    fn idx(self) -> usize {
        match self {
            Tier::Device => 0,
            Tier::Host => 1,
            Tier::Disk => 2,
        }
    }
}

/// One rank's content, enough to rebuild an equal index elsewhere ([`PrefixIndex::dump`],
/// [`PrefixIndex::restore`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankDump {
    pub rank: WorkerRank,
    /// Our hash of each block the rank holds, with its references per tier (device, host, disk),
    /// sorted by hash.
    pub blocks: Vec<(SequenceHash, [u16; 3])>,
    /// The engine's own hash of blocks whose engine hash differs from ours, sorted.
    pub engine: Vec<(EngineBlockHash, SequenceHash)>,
}

/// Per-rank pair limit by default (4 Mi blocks: 1 TiB of KV at 256 KiB per block).
pub const DEFAULT_MAX_BLOCKS_PER_RANK: u64 = 1 << 22;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IndexError {
    #[error("more than {} worker ranks in one index", u16::MAX)]
    TooManyRanks,
    #[error("worker {} rank {}: parent block {:#x} is unknown (events were lost)", .rank.worker, .rank.dp_rank, .parent.0)]
    UnknownParent {
        rank: WorkerRank,
        parent: EngineBlockHash,
    },
    #[error("worker {} rank {} holds {limit} blocks, the limit; store refused", .rank.worker, .rank.dp_rank)]
    RankFull { rank: WorkerRank, limit: u64 },
}

/// Counters since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Blocks stored (each block of each store event, duplicates included).
    pub stored: u64,
    /// Blocks removed (each block of each removal that held a reference).
    pub removed: u64,
    /// Removals of blocks the rank did not hold in that tier.
    pub unknown_removals: u64,
    /// Store events refused because their parent was unknown.
    pub unknown_parents: u64,
    /// Blocks refused because their rank was full (nothing of it could be dropped).
    pub over_capacity: u64,
    /// Pairs dropped, oldest first, to keep a rank within its limit.
    pub evicted: u64,
}

// ------------------------------------------------------------------------------------------ hasher

type Map<K, V> = HashMap<K, V, KeyedBuild>;

/// Most table probes `find_matches` has in flight at once.
const MAX_BATCH: usize = 64;

/// Probes per round of [`PrefixIndex::find_matches_jumping`]'s search (issued together).
const JUMP_FANOUT: usize = 16;

/// Prompts shorter than this (in blocks) take the exact walk even where jumping is allowed: its
/// batched probes cost less than the search's dependent rounds.
pub const JUMP_MIN_BLOCKS: usize = 128;

// ------------------------------------------------------------------------------------------ layout

#[derive(Debug, Clone)]
struct RankSlot {
    id: WorkerRank,
    blocks: u64,
    /// Engine hash → our hash, for the rank's blocks whose engine hash differs from ours.
    engine: Map<EngineBlockHash, SequenceHash>,
    /// Pairs this rank may hold ([`bound`]).
    limit: u64,
    /// The rank's pairs in the order they were stored, oldest first (entries of pairs removed
    /// since are skipped, and compacted away).
    order: std::collections::VecDeque<(SequenceHash, EngineBlockHash)>,
}

/// A slot's rank, flat (16 bytes); `live` false for a free slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct SlotId {
    worker: u64,
    dp_rank: u32,
    live: bool,
}

impl SlotId {
    fn live(r: WorkerRank) -> Self {
        SlotId {
            worker: r.worker,
            dp_rank: r.dp_rank,
            live: true,
        }
    }
}

enum Removal {
    NotHeld,
    Decremented,
    Dropped,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    blocks: BlockTable,
    build: KeyedBuild,
    spill: Vec<Vec<Holder>>,
    /// [`fingerprint`] of each spilled list, kept with it: equal lists have equal fingerprints.
    spill_fp: Vec<u64>,
    spill_free: Vec<u32>,
    ranks: Vec<Option<RankSlot>>,
    rank_ids: Map<WorkerRank, u16>,
    /// Each slot's rank, densely: what [`Self::walked`] checks a hint against without touching
    /// the slot itself.
    slot_ids: Vec<SlotId>,
    /// How many times a slot was given to a rank or freed (the same in both copies of a
    /// shared index, which take the same changes): while it stays, every slot has its rank.
    slot_changes: u64,
    /// Live ranks whose data-parallel rank is not 0.
    nonzero_dp_ranks: usize,
    free_ranks: Vec<u16>,
    max_blocks_per_rank: u64,
    stats: IndexStats,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex::new(DEFAULT_MAX_BLOCKS_PER_RANK)
    }
}

impl PrefixIndex {
    pub fn new(max_blocks_per_rank: u64) -> Self {
        Self::with_seed(max_blocks_per_rank, DEFAULT_TABLE_SEED)
    }

    /// An empty index whose table hasher is keyed by `seed` (pass a random one where prompts or
    /// events come from untrusted clients).
    pub fn with_seed(max_blocks_per_rank: u64, seed: u64) -> Self {
        let build = KeyedBuild::with_key(seed);
        PrefixIndex {
            blocks: BlockTable::new(build),
            build,
            spill: Vec::new(),
            spill_fp: Vec::new(),
            spill_free: Vec::new(),
            ranks: Vec::new(),
            rank_ids: HashMap::with_hasher(build),
            slot_ids: Vec::new(),
            slot_changes: 0,
            nonzero_dp_ranks: 0,
            free_ranks: Vec::new(),
            max_blocks_per_rank,
            stats: IndexStats::default(),
        }
    }

    pub fn stats(&self) -> IndexStats {
        self.stats
    }

    /// Distinct blocks held by any rank.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// (block, rank) pairs.
    pub fn pair_count(&self) -> u64 {
        self.ranks.iter().flatten().map(|r| r.blocks).sum()
    }

    /// Blocks held by `rank` (0 if unknown).
    pub fn rank_blocks(&self, rank: WorkerRank) -> u64 {
        self.slot_of(rank).map_or(0, |s| self.slot(s).blocks)
    }

    /// The blocks `rank` holds in any tier, sorted (for inspection: a full scan of the table).
    pub fn rank_sequences(&self, rank: WorkerRank) -> Vec<SequenceHash> {
        let Some(slot) = self.slot_of(rank) else {
            return Vec::new();
        };
        let mut v: Vec<SequenceHash> = self
            .blocks
            .iter()
            .filter(|&(_, word)| {
                self.holders_of(word)
                    .as_slice()
                    .iter()
                    .any(|h| h.rank == slot)
            })
            .map(|(key, _)| SequenceHash(key))
            .collect();
        v.sort_unstable_by_key(|h| h.0);
        v
    }

    /// Every rank's content (one scan of the table), sorted by rank.
    pub fn dump(&self) -> Vec<RankDump> {
        let mut per: Vec<Vec<(SequenceHash, [u16; 3])>> = vec![Vec::new(); self.ranks.len()];
        for (key, word) in self.blocks.iter() {
            for h in self.holders_of(word).as_slice() {
                if let Some(v) = per.get_mut(usize::from(h.rank)) {
                    v.push((SequenceHash(key), h.refs));
                }
            }
        }
        let mut out: Vec<RankDump> = self
            .ranks
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| {
                let slot = slot.as_ref()?;
                let mut blocks = std::mem::take(&mut per[i]);
                blocks.sort_unstable_by_key(|(h, _)| h.0);
                let mut engine: Vec<(EngineBlockHash, SequenceHash)> =
                    slot.engine.iter().map(|(e, s)| (*e, *s)).collect();
                engine.sort_unstable();
                Some(RankDump {
                    rank: slot.id,
                    blocks,
                    engine,
                })
            })
            .collect();
        out.sort_unstable_by_key(|d| d.rank);
        out
    }

    /// Replaces each dumped rank's content with the dump's (other ranks are untouched). Returns
    /// the pairs restored; stops at the first rank over its limit (what was restored stays).
    pub fn restore(&mut self, dumps: &[RankDump]) -> Result<u64, IndexError> {
        let mut restored = 0;
        for d in dumps {
            let s = self.slot_or_insert(d.rank)?;
            self.clear_rank(d.rank);
            let engine_of: HashMap<SequenceHash, EngineBlockHash> =
                d.engine.iter().map(|&(e, seq)| (seq, e)).collect();
            for &(seq, refs) in &d.blocks {
                for tier in Tier::ALL {
                    for _ in 0..refs[tier.idx()] {
                        self.make_room(s, seq);
                        if self.add(s, seq, tier)? {
                            let e = engine_of.get(&seq).copied();
                            self.note_new(s, seq, e.unwrap_or(EngineBlockHash(seq.0)));
                        }
                    }
                }
                if refs != [0; 3] {
                    restored += 1;
                }
            }
            let slot = Self::slot_mut(&mut self.ranks, s);
            for &(e, seq) in &d.engine {
                slot.engine.insert(e, seq);
            }
        }
        Ok(restored)
    }

    /// Ranks the index knows (registered explicitly or by an event).
    pub fn ranks(&self) -> impl Iterator<Item = WorkerRank> + '_ {
        self.ranks.iter().flatten().map(|r| r.id)
    }

    /// Bytes held by the index's tables (capacity, excluding allocator overhead).
    pub fn memory_bytes(&self) -> usize {
        use std::mem::size_of;
        let table = |cap: usize, entry: usize| cap * (entry + 1);
        self.blocks.bytes()
            + self.spill.capacity() * (size_of::<Vec<Holder>>() + size_of::<u64>())
            + self
                .spill
                .iter()
                .map(|l| l.capacity() * size_of::<Holder>())
                .sum::<usize>()
            + self.ranks.capacity() * size_of::<Option<RankSlot>>()
            + self
                .ranks
                .iter()
                .flatten()
                .map(|r| {
                    table(
                        r.engine.capacity(),
                        size_of::<(EngineBlockHash, SequenceHash)>(),
                    ) + r.order.capacity() * size_of::<(SequenceHash, EngineBlockHash)>()
                })
                .sum::<usize>()
            + table(self.rank_ids.capacity(), size_of::<(WorkerRank, u16)>())
    }

    /// Makes `rank` known (idempotent); its slot is kept until [`Self::remove_worker`].
    pub fn register(&mut self, rank: WorkerRank) -> Result<(), IndexError> {
        self.slot_or_insert(rank).map(|_| ())
    }

    fn slot_of(&self, rank: WorkerRank) -> Option<u16> {
        self.rank_ids.get(&rank).copied()
    }

    // Slot ids come only from `rank_ids`, which is updated with `ranks` under `&mut self`: no
    // input reaches a dead slot, so a miss is a bug in this module, not a bad event.
    #[allow(clippy::expect_used)]
    fn slot(&self, s: u16) -> &RankSlot {
        self.ranks[usize::from(s)]
            .as_ref()
            .expect("rank_ids only names live slots")
    }

    #[allow(clippy::expect_used)] // as in `slot`
    fn slot_mut(ranks: &mut [Option<RankSlot>], s: u16) -> &mut RankSlot {
        ranks[usize::from(s)]
            .as_mut()
            .expect("rank_ids only names live slots")
    }

    fn slot_or_insert(&mut self, rank: WorkerRank) -> Result<u16, IndexError> {
        if let Some(s) = self.slot_of(rank) {
            return Ok(s);
        }
        let s = match self.free_ranks.pop() {
            Some(s) => s,
            None => {
                // u16::MAX itself stays unused so the count fits the error message's bound.
                let s = u16::try_from(self.ranks.len())
                    .ok()
                    .filter(|&s| s < u16::MAX)
                    .ok_or(IndexError::TooManyRanks)?;
                self.ranks.push(None);
                self.slot_ids.push(SlotId::default());
                s
            }
        };
        self.ranks[usize::from(s)] = Some(RankSlot {
            id: rank,
            blocks: 0,
            engine: HashMap::with_hasher(self.build),
            limit: self.max_blocks_per_rank,
            order: Default::default(),
        });
        self.rank_ids.insert(rank, s);
        self.slot_ids[usize::from(s)] = SlotId::live(rank);
        self.slot_changes += 1;
        self.nonzero_dp_ranks += usize::from(rank.dp_rank != 0);
        Ok(s)
    }

    /// Our hash of the block the rank knows by `engine` (its own hash or ours), if it holds it.
    fn resolve(&self, s: u16, engine: EngineBlockHash) -> Option<SequenceHash> {
        if let Some(&seq) = self.slot(s).engine.get(&engine) {
            return Some(seq);
        }
        let seq = SequenceHash(engine.0);
        self.holders(seq)
            .is_some_and(|h| h.as_slice().iter().any(|h| h.rank == s))
            .then_some(seq)
    }

    /// The holders behind a table value word.
    fn holders_of(&self, word: u64) -> HolderList<'_> {
        match Holders::unpack(word) {
            Holders::One(h) => HolderList::One(h),
            Holders::Spill(i) => HolderList::Many(&self.spill[i as usize]),
        }
    }

    fn holders(&self, seq: SequenceHash) -> Option<HolderList<'_>> {
        self.blocks.get(seq.0).map(|w| self.holders_of(w))
    }

    /// Applies a `BlockStored` event: consecutive blocks (engine hash, our local hash) following
    /// `parent` (the engine hash of the block before the first, None at a sequence start). Returns
    /// the number of blocks stored; on error, the blocks before the failing one stay stored.
    pub fn store(
        &mut self,
        rank: WorkerRank,
        tier: Tier,
        parent: Option<EngineBlockHash>,
        blocks: impl IntoIterator<Item = (EngineBlockHash, LocalBlockHash)>,
    ) -> Result<usize, IndexError> {
        let s = self.slot_or_insert(rank)?;
        let mut prev = match parent {
            None => None,
            Some(p) => match self.resolve(s, p) {
                Some(seq) => Some(seq),
                None => {
                    self.stats.unknown_parents += 1;
                    return Err(IndexError::UnknownParent { rank, parent: p });
                }
            },
        };
        let mut n = 0;
        for (engine, local) in blocks {
            let seq = SequenceHash::chain(prev, local);
            prev = Some(seq);
            self.make_room(s, seq);
            match self.add(s, seq, tier) {
                Err(e) => {
                    self.stats.over_capacity += 1;
                    return Err(e);
                }
                Ok(true) => self.note_new(s, seq, engine),
                Ok(false) => {}
            }
            if engine.0 != seq.0 {
                Self::slot_mut(&mut self.ranks, s)
                    .engine
                    .insert(engine, seq);
            }
            self.stats.stored += 1;
            n += 1;
        }
        Ok(n)
    }

    /// Adds a reference of `tier` to the pair; Ok(true) when the pair is new.
    fn add(&mut self, s: u16, seq: SequenceHash, tier: Tier) -> Result<bool, IndexError> {
        let slot = Self::slot_mut(&mut self.ranks, s);
        let limit = slot.limit;
        let full = slot.blocks >= limit;
        let refused = IndexError::RankFull {
            rank: slot.id,
            limit,
        };
        let t = tier.idx();
        let (word, new) = self
            .blocks
            .get_or_insert(seq.0, Holders::One(Holder::new(s, tier)).pack());
        if new {
            if full {
                self.blocks.remove(seq.0);
                return Err(refused);
            }
        } else {
            match Holders::unpack(*word) {
                Holders::One(mut h) if h.rank == s => {
                    h.refs[t] = h.refs[t].saturating_add(1);
                    *word = Holders::One(h).pack();
                    return Ok(false);
                }
                Holders::One(h) => {
                    if full {
                        return Err(refused);
                    }
                    let new = Holder::new(s, tier);
                    let list = if h.rank < s {
                        vec![h, new]
                    } else {
                        vec![new, h]
                    };
                    let fp = fingerprint(&list);
                    let i = match self.spill_free.pop() {
                        Some(i) => {
                            self.spill[i as usize] = list;
                            self.spill_fp[i as usize] = fp;
                            i
                        }
                        None => {
                            self.spill.push(list);
                            self.spill_fp.push(fp);
                            (self.spill.len() - 1) as u32
                        }
                    };
                    *word = Holders::Spill(i).pack();
                }
                Holders::Spill(i) => {
                    let list = &mut self.spill[i as usize];
                    let at = match holders::find(list, s) {
                        Ok(at) => {
                            let h = &mut list[at];
                            h.refs[t] = h.refs[t].saturating_add(1);
                            self.spill_fp[i as usize] = fingerprint(list);
                            return Ok(false);
                        }
                        Err(at) => at,
                    };
                    if full {
                        return Err(refused);
                    }
                    list.insert(at, Holder::new(s, tier));
                    self.spill_fp[i as usize] = fingerprint(list);
                }
            }
        }
        slot.blocks += 1;
        Ok(true)
    }

    fn release(&mut self, s: u16, seq: SequenceHash, t: usize) -> Removal {
        let Some(word) = self.blocks.get_mut(seq.0) else {
            return Removal::NotHeld;
        };
        match Holders::unpack(*word) {
            Holders::One(mut h) => {
                if h.rank != s || h.refs[t] == 0 {
                    return Removal::NotHeld;
                }
                h.refs[t] -= 1;
                if h.is_empty() {
                    self.blocks.remove(seq.0);
                    return Removal::Dropped;
                }
                *word = Holders::One(h).pack();
                Removal::Decremented
            }
            Holders::Spill(i) => {
                let list = &mut self.spill[i as usize];
                let Some(pos) = holders::find(list, s).ok().filter(|&p| list[p].refs[t] > 0) else {
                    return Removal::NotHeld;
                };
                list[pos].refs[t] -= 1;
                if !list[pos].is_empty() {
                    self.spill_fp[i as usize] = fingerprint(list);
                    return Removal::Decremented;
                }
                list.remove(pos);
                self.spill_fp[i as usize] = fingerprint(list);
                if let [only] = list.as_slice() {
                    *word = Holders::One(*only).pack();
                    Self::free_spill(&mut self.spill, &mut self.spill_free, i);
                }
                Removal::Dropped
            }
        }
    }

    fn free_spill(spill: &mut [Vec<Holder>], free: &mut Vec<u32>, i: u32) {
        let list = &mut spill[i as usize];
        list.clear();
        if list.capacity() > 8 {
            list.shrink_to(4);
        }
        free.push(i);
    }

    /// Applies a `BlockRemoved` event (engine hashes, or ours). Returns the pairs that went away.
    pub fn remove(
        &mut self,
        rank: WorkerRank,
        tier: Tier,
        engine_hashes: impl IntoIterator<Item = EngineBlockHash>,
    ) -> usize {
        let Some(s) = self.slot_of(rank) else {
            self.stats.unknown_removals += engine_hashes.into_iter().count() as u64;
            return 0;
        };
        let mut dropped = 0;
        for e in engine_hashes {
            let seq = self
                .slot(s)
                .engine
                .get(&e)
                .copied()
                .unwrap_or(SequenceHash(e.0));
            match self.release(s, seq, tier.idx()) {
                Removal::NotHeld => {
                    self.stats.unknown_removals += 1;
                    continue;
                }
                Removal::Decremented => {}
                Removal::Dropped => {
                    let slot = Self::slot_mut(&mut self.ranks, s);
                    slot.blocks -= 1;
                    slot.engine.remove(&e);
                    dropped += 1;
                }
            }
            self.stats.removed += 1;
        }
        dropped
    }

    /// Applies `AllBlocksCleared`: the rank holds nothing (it stays registered).
    pub fn clear_rank(&mut self, rank: WorkerRank) {
        let Some(s) = self.slot_of(rank) else { return };
        self.drop_slots(&[s]);
        let slot = Self::slot_mut(&mut self.ranks, s);
        slot.blocks = 0;
        slot.engine = HashMap::with_hasher(self.build);
        slot.order = Default::default();
    }

    /// The workers holding at least one rank here (each once).
    pub fn workers(&self) -> std::collections::HashSet<u64> {
        self.rank_ids.keys().map(|r| r.worker).collect()
    }

    /// Forgets every rank of `worker` and its blocks.
    pub fn remove_worker(&mut self, worker: u64) {
        let gone: Vec<u16> = self
            .rank_ids
            .iter()
            .filter(|(r, _)| r.worker == worker)
            .map(|(_, &s)| s)
            .collect();
        if gone.is_empty() {
            return;
        }
        self.drop_slots(&gone);
        for s in gone {
            if let Some(slot) = self.ranks[usize::from(s)].take() {
                self.rank_ids.remove(&slot.id);
                self.slot_ids[usize::from(s)] = SlotId::default();
                self.slot_changes += 1;
                self.nonzero_dp_ranks -= usize::from(slot.id.dp_rank != 0);
            }
            self.free_ranks.push(s);
        }
    }

    fn drop_slots(&mut self, slots: &[u16]) {
        let spill = &mut self.spill;
        let spill_fp = &mut self.spill_fp;
        let free = &mut self.spill_free;
        self.blocks.retain(|_, word| match Holders::unpack(*word) {
            Holders::One(h) => !slots.contains(&h.rank),
            Holders::Spill(i) => {
                let list = &mut spill[i as usize];
                list.retain(|h| !slots.contains(&h.rank));
                spill_fp[i as usize] = fingerprint(list);
                match list.as_slice() {
                    [] => {
                        Self::free_spill(spill, free, i);
                        false
                    }
                    [only] => {
                        *word = Holders::One(*only).pack();
                        Self::free_spill(spill, free, i);
                        true
                    }
                    _ => true,
                }
            }
        });
    }
}

#[cfg(test)]
mod tests;
