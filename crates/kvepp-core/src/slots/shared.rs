//! The slot tracker for many threads at once: the [`super`] module's semantics without one
//! lock over the whole of it, so bookings and releases on different ranks or prefixes do not wait
//! for one another, and picks read loads without any lock.
//!
//! What it owns, each behind its own lock:
//! - **ranks**: a cell per dense id (`RANKS_PER_CHUNK` to a chunk, chunks made on first use and
//!   never moved), each with its state under a small mutex and, beside it, the state's view
//!   published as atomics under a sequence counter (a seqlock), which picks read without a lock;
//!   the map from rank to dense id (`registry`) is locked only to register, unregister, or
//!   resolve an id a caller's hint got wrong;
//! - **prompts**: the active requests' trie, split into `TRIE_SHARDS` tries by the prompt's first
//!   block (two prompts share a prefix only if they share their first block, so a walk reads one
//!   shard and sees every rank's share of the prompt, and a rank's distinct blocks are the sum
//!   over shards);
//! - **requests**: the active requests by id, in `REQUEST_SHARDS` maps by a keyed hash of the id.
//! - **load order**: each rank's load key beside its view ([`LoadOrder`]), written with it under
//!   the rank's cell lock; rekeyed as a whole when the cost's weights or block size change.
//!
//! Invariants:
//! - a rank's counts equal the sum over its live bookings (those in the request maps): a booking
//!   changes the counts and inserts its request while holding its request shard and its rank's
//!   cell, a release removes the request and gives back what it held under the same two locks, so
//!   no interleaving counts a request twice or drops it (`tests::concurrent_bookings_keep_loads_equal_to_the_live_bookings`);
//! - a rank's `version` changes with every change of its load, and a booking that expects a
//!   version books only if it is still that one, checked under the rank's cell lock: a pick books
//!   exactly the counts it read, or nothing;
//! - locks are always taken in the order registry → request shard → rank cell → trie shard, and
//!   none is held across a call out, so they cannot deadlock (a booking first reads its trie
//!   shard with no other lock held, to plan its path: the hash comparisons along the prompt;
//!   the write lock then only counts the request on the planned nodes, or, if a write changed
//!   some of them meanwhile, compares hashes again from the last unchanged one);
//! - an unregistered rank's cell is marked free (its view says so) before its requests are
//!   removed, and its dense id is reused only after they are, so no request outlives its rank
//!   and a stale hint never reads another rank's load as its own.
//!
//! What a pick reads is not one snapshot: the trie walk (how much of the prompt each rank has
//! active) and each rank's view are read at slightly different moments. The version check at
//! booking covers the chosen rank's counts; the walk only refines its decode-block estimate.

use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::active::{ActiveTrie, HeldScratch};
use super::order::{KeyParams, KeyReader, LoadOrder, VisitScratch};
use super::{
    output_weight, Active, Map, NewRequest, PotentialLoad, RankLoad, RankState, RankView, SlotError,
};
use crate::hash::SequenceHash;
use crate::types::{KeyedBuild, WorkerRank};

const TRIE_SHARDS: usize = 64;
const REQUEST_SHARDS: usize = 64;
const RANKS_PER_CHUNK: usize = 256;
const CHUNKS: usize = 4096;
/// Tries at a lock-free read of a rank's view before taking its lock.
const SPINS: usize = 64;

/// One dense id's rank: its state, and the view picks read without the lock. Aligned to two
/// cache lines, so a booking on one rank does not invalidate the lines picks read of another.
#[derive(Debug, Default)]
#[repr(align(128))]
struct RankCell {
    state: Mutex<Option<RankState>>,
    /// Even: the view below is whole; odd: it is being written.
    seq: AtomicU64,
    worker: AtomicU64,
    dp_rank_plus_one: AtomicU32,
    active_requests: AtomicU32,
    version: AtomicU64,
    prefill_tokens: AtomicU64,
    decode_blocks: AtomicU64,
}

impl RankCell {
    /// Publishes the view `v` (the caller holds `self.state`'s lock, so writers are one at a
    /// time).
    fn publish(&self, v: &RankView) {
        let seq = self.seq.load(Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.worker.store(v.worker, Ordering::Relaxed);
        self.dp_rank_plus_one
            .store(v.dp_rank_plus_one, Ordering::Relaxed);
        self.active_requests
            .store(v.active_requests, Ordering::Relaxed);
        self.version.store(v.version, Ordering::Relaxed);
        self.prefill_tokens
            .store(v.prefill_tokens, Ordering::Relaxed);
        self.decode_blocks.store(v.decode_blocks, Ordering::Relaxed);
        self.seq.store(seq.wrapping_add(2), Ordering::Release);
    }

    /// The last published view, whole: retried while a writer is between its two stores, and
    /// after a few tries read under the state's lock instead (a writer preempted mid-publish
    /// must not keep a reader spinning for its time slice).
    fn view(&self) -> RankView {
        for _ in 0..SPINS {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 0 {
                let v = RankView {
                    worker: self.worker.load(Ordering::Relaxed),
                    dp_rank_plus_one: self.dp_rank_plus_one.load(Ordering::Relaxed),
                    active_requests: self.active_requests.load(Ordering::Relaxed),
                    version: self.version.load(Ordering::Relaxed),
                    prefill_tokens: self.prefill_tokens.load(Ordering::Relaxed),
                    decode_blocks: self.decode_blocks.load(Ordering::Relaxed),
                };
                fence(Ordering::Acquire);
                if self.seq.load(Ordering::Relaxed) == before {
                    return v;
                }
            }
            std::hint::spin_loop();
        }
        // Writers publish under this lock, so once it is ours the state is what they published.
        self.state
            .lock()
            .as_ref()
            .map_or_else(RankView::default, RankState::view)
    }
}

/// Which dense id each registered rank has, and the ids free for reuse.
#[derive(Debug)]
struct Registry {
    ids: Map<WorkerRank, u32>,
    free_ids: Vec<u32>,
}

/// One shard of the active requests, by id.
type Requests = HashMap<Arc<str>, Active>;

/// See the module documentation.
#[derive(Debug)]
pub struct SharedSlots {
    registry: RwLock<Registry>,
    chunks: Box<[OnceLock<Box<[RankCell]>>]>,
    /// Dense ids handed out so far (free ones included): what a walk's scratch spans.
    len: AtomicUsize,
    tries: Box<[RwLock<ActiveTrie>]>,
    requests: Box<[Mutex<Requests>]>,
    /// Keys the shard choice of request ids and prompts (both untrusted).
    keys: KeyedBuild,
    stale_after: Duration,
    /// Registered ranks by load key ([`LoadOrder`]).
    order: LoadOrder,
    /// Bumped by every registration of a new rank and every unregistration.
    generation: AtomicU64,
}

impl SharedSlots {
    /// A tracker whose tables are keyed by `seed` (pass a random one where ids and hashes come
    /// from untrusted clients); requests older than `stale_after` go at [`Self::expire`].
    pub fn with_seed(stale_after: Duration, seed: u64) -> Self {
        SharedSlots {
            registry: RwLock::new(Registry {
                ids: HashMap::with_hasher(KeyedBuild::with_key(seed)),
                free_ids: Vec::new(),
            }),
            chunks: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            len: AtomicUsize::new(0),
            tries: (0..TRIE_SHARDS)
                .map(|_| RwLock::new(ActiveTrie::with_seed(seed)))
                .collect(),
            requests: (0..REQUEST_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            keys: KeyedBuild::with_key(seed.rotate_left(17)),
            stale_after,
            order: LoadOrder::new(CHUNKS, RANKS_PER_CHUNK),
            generation: AtomicU64::new(0),
        }
    }

    /// Publishes a rank's view (its cell lock held) and its load key.
    fn publish(&self, id: u32, cell: &RankCell, state: Option<&RankState>) {
        let v = state.map_or_else(RankView::default, RankState::view);
        cell.publish(&v);
        self.order.set(id, &v);
    }

    fn cell(&self, id: u32) -> Option<&RankCell> {
        let id = id as usize;
        self.chunks
            .get(id / RANKS_PER_CHUNK)?
            .get()?
            .get(id % RANKS_PER_CHUNK)
    }

    /// The cell of a new dense id (its chunk made if this is the chunk's first).
    fn new_cell(&self, id: u32) -> Option<&RankCell> {
        let id = id as usize;
        let chunk = self
            .chunks
            .get(id / RANKS_PER_CHUNK)?
            .get_or_init(|| (0..RANKS_PER_CHUNK).map(|_| RankCell::default()).collect());
        chunk.get(id % RANKS_PER_CHUNK)
    }

    fn request_shard(&self, id: &str) -> &Mutex<Requests> {
        let i = self.keys.hash_one(id) as usize % REQUEST_SHARDS;
        &self.requests[i]
    }

    /// The trie shard of a prompt: by its first block (an empty prompt's is shard 0).
    fn trie_shard(&self, hashes: &[SequenceHash]) -> u16 {
        hashes.first().map_or(0, |h| {
            (self.keys.hash_one(h.0) as usize % TRIE_SHARDS) as u16
        })
    }

    /// [`Self::register`] for a caller that remembers the rank's dense id (`hint`): when the
    /// hint still names the rank (its published view says so), no lock is taken at all.
    pub fn register_at(&self, rank: WorkerRank, hint: u32) -> Option<u32> {
        if self.cell(hint).is_some_and(|c| c.view().is(rank)) {
            return Some(hint);
        }
        self.register(rank)
    }

    /// Makes a rank schedulable (idempotent); its dense id.
    pub fn register(&self, rank: WorkerRank) -> Option<u32> {
        if let Some(&id) = self.registry.read().ids.get(&rank) {
            return Some(id);
        }
        let mut reg = self.registry.write();
        if let Some(&id) = reg.ids.get(&rank) {
            return Some(id);
        }
        let id = match reg.free_ids.pop() {
            Some(id) => id,
            None => {
                let id = self.len.load(Ordering::Relaxed);
                if id >= CHUNKS * RANKS_PER_CHUNK {
                    tracing::error!(?rank, ranks = id, "slot tracker full: rank not registered");
                    return None;
                }
                id as u32
            }
        };
        let cell = self.new_cell(id)?;
        {
            let mut state = cell.state.lock();
            *state = Some(RankState::new(rank));
            self.publish(id, cell, state.as_ref());
        }
        if id as usize >= self.len.load(Ordering::Relaxed) {
            self.len.store(id as usize + 1, Ordering::Release);
        }
        reg.ids.insert(rank, id);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Some(id)
    }

    /// Removes every rank of `workers` and their active requests (one pass over the requests
    /// for all of them).
    pub fn unregister_workers(&self, workers: &[u64]) {
        let mut reg = self.registry.write();
        let gone: Vec<(WorkerRank, u32)> = reg
            .ids
            .iter()
            .filter(|(r, _)| workers.contains(&r.worker))
            .map(|(&r, &id)| (r, id))
            .collect();
        if gone.is_empty() {
            return;
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        for &(rank, id) in &gone {
            reg.ids.remove(&rank);
            if let Some(cell) = self.cell(id) {
                let mut state = cell.state.lock();
                *state = None;
                self.publish(id, cell, None);
            }
        }
        // No booking can land on the freed cells any more; remove what they held.
        for shard in self.requests.iter() {
            let mut map = shard.lock();
            let mut dropped = Vec::new();
            map.retain(|_, a| {
                let keep = !gone.iter().any(|&(_, id)| id == a.rank);
                if !keep {
                    dropped.push((a.shard, a.rank, a.end));
                }
                keep
            });
            for (t, rank, end) in dropped {
                self.tries[usize::from(t)].write().remove(rank, end);
            }
        }
        reg.free_ids.extend(gone.iter().map(|&(_, id)| id));
    }

    /// Changes with every registration of a new rank and every unregistration (what a cached
    /// map of dense ids checks).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether every rank's load key is computed with `p`; if not, rekeys them all (once: a
    /// caller that finds a rekey under way elsewhere gets false and reads every rank).
    pub fn keyed_by(&self, p: &KeyParams) -> bool {
        if self.order.keyed_with(p) {
            return true;
        }
        // Registrations wait (a new rank's key would otherwise be computed with the old
        // parameters after the pass went by).
        let _registry = self.registry.read();
        let len = self.len.load(Ordering::Acquire);
        self.order.rekey(p, len, |id| {
            if let Some(cell) = self.cell(id) {
                let state = cell.state.lock();
                let v = state
                    .as_ref()
                    .map_or_else(RankView::default, RankState::view);
                self.order.set(id, &v);
            }
        }) && self.order.keyed_with(p)
    }

    /// A lower bound of every registered rank's load key.
    pub fn least_key(&self) -> f64 {
        self.order.least(self.len.load(Ordering::Acquire))
    }

    /// A registered rank of least load key, or nearly (its dense id).
    pub fn least_loaded(&self) -> Option<u32> {
        self.order.least_id(self.len.load(Ordering::Acquire))
    }

    /// The load key of dense id `id` (+∞: free or none).
    #[inline]
    pub fn load_key(&self, id: u32) -> f64 {
        self.order.key(id)
    }

    /// A reader of load keys for many ids in a row ([`Self::load_key`] each, faster).
    pub fn load_keys(&self) -> KeyReader<'_> {
        self.order.reader()
    }

    /// Calls `visit(id, key)` for every dense id whose load key is at most the limit (`limit`,
    /// then what each visit returns), without reading the others' (see the `order` module).
    pub fn visit_by_load(
        &self,
        limit: f64,
        scratch: &mut VisitScratch,
        visit: impl FnMut(u32, f64) -> f64,
    ) {
        self.order
            .visit(self.len.load(Ordering::Acquire), limit, scratch, visit);
    }

    /// The dense id of `rank` (for a hint that [`Self::project`] found wrong).
    pub fn dense_id(&self, rank: WorkerRank) -> Option<u32> {
        self.registry.read().ids.get(&rank).copied()
    }

    pub fn ranks(&self) -> Vec<WorkerRank> {
        self.registry.read().ids.keys().copied().collect()
    }

    /// Every registered rank with its current load (unordered).
    pub fn loads(&self) -> Vec<(WorkerRank, RankLoad)> {
        let reg = self.registry.read();
        reg.ids
            .iter()
            .filter_map(|(&r, &id)| Some((r, self.cell(id)?.state.lock().as_ref()?.load())))
            .collect()
    }

    pub fn load(&self, rank: WorkerRank) -> Option<RankLoad> {
        let id = self.dense_id(rank)?;
        let state = self.cell(id)?.state.lock();
        state.as_ref().filter(|s| s.id == rank).map(RankState::load)
    }

    pub fn is_active(&self, request_id: &str) -> bool {
        self.request_shard(request_id)
            .lock()
            .contains_key(request_id)
    }

    /// Number of active requests.
    pub fn active_count(&self) -> usize {
        // Summed when asked (metrics, tests) rather than counted by every booking on one
        // shared counter.
        self.requests.iter().map(|m| m.lock().len()).sum()
    }

    /// Books a request's prompt blocks and prefill tokens on a registered `rank`.
    pub fn add(
        &self,
        request_id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
        now: Instant,
    ) -> Result<(), SlotError> {
        let booking = NewRequest {
            id: request_id.into(),
            hashes: Arc::from(hashes),
            new_isl_tokens,
            now,
        };
        self.add_booking(booking, rank, None, None).map(|_| ())
    }

    /// Books `booking` on `rank` (whose dense id `hint` may name), only if the rank's load
    /// version is still `expected` when given. Ok(false): it changed, nothing was booked.
    pub fn add_booking(
        &self,
        booking: NewRequest,
        rank: WorkerRank,
        expected: Option<u64>,
        hint: Option<u32>,
    ) -> Result<bool, SlotError> {
        // The path through the prompt's trie shard is worked out first, under its read lock
        // alone (comparing the prompt's hashes along it); the write lock below only counts the
        // request on the nodes found, unless a write meanwhile changed them.
        let shard = self.trie_shard(&booking.hashes);
        let plan = self.tries[usize::from(shard)].read().plan(&booking.hashes);
        let mut map = self.request_shard(&booking.id).lock();
        if map.contains_key(&booking.id) {
            return Err(SlotError::DuplicateRequest(booking.id.to_string()));
        }
        let live = |id: u32| {
            let cell = self.cell(id)?;
            let state = cell.state.lock();
            state
                .as_ref()
                .is_some_and(|s| s.id == rank)
                .then_some((id, cell, state))
        };
        let found = match hint.and_then(live) {
            Some(f) => Some(f),
            // The registry comes before a request shard in the lock order: look up apart.
            None => {
                drop(map);
                let id = self.dense_id(rank).ok_or(SlotError::UnknownRank(rank))?;
                map = self.request_shard(&booking.id).lock();
                if map.contains_key(&booking.id) {
                    return Err(SlotError::DuplicateRequest(booking.id.to_string()));
                }
                live(id)
            }
        };
        let (id, cell, mut state) = found.ok_or(SlotError::UnknownRank(rank))?;
        let Some(s) = state.as_mut() else {
            return Err(SlotError::UnknownRank(rank));
        };
        if expected.is_some_and(|v| v != s.version) {
            return Ok(false);
        }
        let (end, added) =
            self.tries[usize::from(shard)]
                .write()
                .insert_planned(id, &booking.hashes, &plan);
        s.take(booking.new_isl_tokens, added);
        self.publish(id, cell, Some(s));
        drop(state);
        map.insert(
            booking.id,
            Active {
                rank: id,
                shard,
                end,
                prefill_tokens: booking.new_isl_tokens,
                output_blocks: 0.0,
                added: booking.now,
            },
        );
        Ok(true)
    }

    /// Runs `f` on an active request and its rank's state (when still registered), and
    /// publishes the rank's view after.
    fn with_request<T>(
        &self,
        request_id: &str,
        f: impl FnOnce(&mut Active, Option<&mut RankState>) -> T,
    ) -> Result<T, SlotError> {
        let mut map = self.request_shard(request_id).lock();
        let active = map
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.to_owned()))?;
        let Some(cell) = self.cell(active.rank) else {
            return Ok(f(active, None));
        };
        let mut state = cell.state.lock();
        let out = f(active, state.as_mut());
        self.publish(active.rank, cell, state.as_ref());
        Ok(out)
    }

    /// The request's first output token exists: its prefill tokens no longer load the rank.
    /// Repeating it is a no-op.
    pub fn prefill_complete(&self, request_id: &str) -> Result<(), SlotError> {
        self.with_request(request_id, |a, s| {
            let tokens = std::mem::take(&mut a.prefill_tokens);
            if let Some(s) = s {
                s.prefill_done(tokens);
            }
        })
    }

    /// The request produced another block of output (its output blocks weigh on the rank's decode load).
    pub fn add_output_block(
        &self,
        request_id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), SlotError> {
        let w = output_weight(decay_fraction);
        self.with_request(request_id, |a, s| {
            a.output_blocks += w;
            if let Some(s) = s {
                s.output(w);
            }
        })
    }

    /// Releases everything the request holds. Idempotent; returns whether it was active.
    pub fn free(&self, request_id: &str) -> bool {
        let mut map = self.request_shard(request_id).lock();
        let Some(active) = map.remove(request_id) else {
            return false;
        };
        self.release(&active);
        true
    }

    /// Gives back what a request removed from its map held (the caller holds that map's lock).
    fn release(&self, active: &Active) {
        let cell = self.cell(active.rank);
        let mut state = cell.map(|c| c.state.lock());
        let freed = self.tries[usize::from(active.shard)]
            .write()
            .remove(active.rank, active.end);
        if let (Some(cell), Some(guard)) = (cell, state.as_mut()) {
            if let Some(s) = guard.as_mut() {
                s.give_back(active, freed);
            }
            self.publish(active.rank, cell, guard.as_ref());
        }
    }

    /// Drops requests older than the stale limit at `now`; returns how many.
    pub fn expire(&self, now: Instant) -> usize {
        let mut expired = 0;
        for shard in self.requests.iter() {
            let mut map = shard.lock();
            let stale: Vec<Arc<str>> = map
                .iter()
                .filter(|(_, a)| now.saturating_duration_since(a.added) > self.stale_after)
                .map(|(id, _)| id.clone())
                .collect();
            for id in stale {
                if let Some(active) = map.remove(&id) {
                    let rank = self
                        .cell(active.rank)
                        .and_then(|c| c.state.lock().as_ref().map(|s| s.id));
                    tracing::warn!(request = ?id, worker = rank.map(|r| r.worker), dp_rank = rank.map(|r| r.dp_rank), "stale request expired from load accounting");
                    self.release(&active);
                    expired += 1;
                }
            }
        }
        expired
    }

    /// Bookings whose planned path a write changed before they took the trie's write lock
    /// (they compared the prompt's hashes again under it, from the last unchanged node).
    pub fn stale_plans(&self) -> u64 {
        self.tries.iter().map(|t| t.read().stale_plans()).sum()
    }

    /// How many leading blocks of `hashes` every rank has active: one walk down the prompt's
    /// trie shard into `scratch` ([`Self::project`] reads it).
    pub fn walk_held(&self, hashes: &[SequenceHash], scratch: &mut HeldScratch) {
        let ranks = self.len.load(Ordering::Acquire);
        let shard = self.trie_shard(hashes);
        self.tries[usize::from(shard)]
            .read()
            .walk(hashes, scratch, ranks);
    }

    /// [`Self::walk_held`] that copies the path's rank lists instead of writing an entry per
    /// rank (see `ActiveTrie::walk_path`): for a pick that reads few ranks. A node with more
    /// than `wide` ranks may be copied as a bit set, its ranks then not listed.
    pub fn walk_held_path(&self, hashes: &[SequenceHash], scratch: &mut HeldScratch, wide: usize) {
        let shard = self.trie_shard(hashes);
        self.tries[usize::from(shard)]
            .read()
            .walk_path(hashes, scratch, wide);
    }

    /// `rank`'s load if it took a request of `blocks` prompt blocks and `new_isl_tokens` to
    /// prefill, from its published view and a walk ([`Self::walk_held`]), with its version;
    /// `hint` is the rank's remembered dense id. None: the hint is wrong (resolve it with
    /// [`Self::dense_id`]).
    #[inline]
    pub fn project(
        &self,
        held: &HeldScratch,
        rank: WorkerRank,
        hint: u32,
        blocks: u64,
        new_isl_tokens: u64,
    ) -> Option<(PotentialLoad, u64)> {
        let v = self.cell(hint)?.view();
        v.is(rank).then(|| {
            let h = held.get(hint as usize);
            (v.potential(rank, blocks, h, new_isl_tokens), v.version)
        })
    }

    /// A rank's load if it took a request of `blocks` prompt blocks whose first `held` it has
    /// active and `new_isl_tokens` to prefill, with its version (an unknown rank counts as idle,
    /// version None).
    pub fn projection(
        &self,
        rank: WorkerRank,
        blocks: u64,
        held: u64,
        new_isl_tokens: u64,
    ) -> (PotentialLoad, Option<u64>) {
        let view = self.registered_view(rank).map(|(_, v)| v);
        RankView::projected(view, rank, blocks, held, new_isl_tokens)
    }

    /// `rank`'s dense id and published view, when it is registered.
    fn registered_view(&self, rank: WorkerRank) -> Option<(u32, RankView)> {
        let id = self.dense_id(rank)?;
        let v = self.cell(id)?.view();
        v.is(rank).then_some((id, v))
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
        let blocks = hashes.len() as u64;
        ranks
            .into_iter()
            .map(|r| {
                // One lookup of the rank for both its walk result and its view.
                let found = self.registered_view(r);
                let h = found.map_or(0, |(id, _)| held.get(id as usize));
                RankView::projected(found.map(|(_, v)| v), r, blocks, h, new_isl_tokens)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
