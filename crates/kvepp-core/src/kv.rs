//! The KV-aware picker's state and ranking: for each candidate, the cached prefix of the request
//! (from the engines' KV events, or approximately from our own past picks), its active load (slot
//! tracker), and Dynamo's cost; the cheapest wins (see [`super::cost`]). What a pick books is held
//! by a [`SlotGuard`].
//!
//! Invariants: the approximate index holds at most `approx_blocks_per_endpoint` references per
//! endpoint (oldest evicted first, before new blocks are stored); a forgotten endpoint leaves
//! nothing in either index or the slot tracker; locks are held only for the lookup or the update,
//! never across a call out.
//!
//! Concurrency: both prefix indexes are [`SharedIndex`]es, so a pick's lookup never waits for KV
//! events (or another pick's routed blocks) being applied. The slot tracker sits behind a
//! read-write lock: a pick holds it shared only to walk the active requests' trie and copy the
//! ranks' loads (a few bytes each), then scores its candidates without it; a booking takes the
//! write lock only to add the request (one count per trie node on its path), and only if the
//! chosen rank's load is still the one the pick read (its version); otherwise the router picks
//! again. So select-and-book is atomic per decision while picks and bookings hardly wait for one
//! another.
//!
//! Cost of a pick over `n` candidates: one search of the KV-event index (a few dozen probes per
//! distinct set of holders along the prompt, however long its cached prefix: see
//! [`super::index::PrefixIndex::find_matches_jumping`]; the approximate index, whose FIFO evicts
//! prefixes first, is walked block by block), one walk down the slot tracker's trie and one copy
//! of its ranks' loads, then O(1) per candidate (the walks' results and its load, each found
//! through a hint kept in the endpoint beside its worker id), and O(n) arithmetic, in buffers
//! reused from pick to pick.
//!
//! Modes, per request ([`PrefixMode`]): `token_ids` (the completions prompt was token ids),
//! `tokens` (tokenized by us), `approximate` (no tokenizer: hashes of fixed-size byte blocks of
//! the prompt, matched against what we routed before, per endpoint, bounded FIFO of blocks) and
//! `none` (no prompt: load only).
//!
//! Every endpoint is one worker (`worker_id` of its address) with rank 0 for load; its cached
//! prefix is the best over the data-parallel ranks its events came from.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Instant;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::cost::{CandidateLoad, CostModel, CostWeights, Overlap};
use super::index::{EngineBlockHash, MatchScratch, RankOverlap, SharedIndex, Tier};
use super::load::EndpointLoad;
use super::predict::{EndpointSpeed, TtftFeatures, TtftModel};
use super::slots::{project, HeldScratch, RankView, SlotTracker, WorkerRank};
use super::{Endpoint, PickContext};
use crate::hash::{block_seed, LocalBlockHash, PrefixMemo, SequenceHash, XXH3_SEED};

/// How the prefix of a request was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrefixMode {
    TokenIds,
    Tokens,
    Approximate,
    None,
}

impl PrefixMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixMode::TokenIds => "token_ids",
            PrefixMode::Tokens => "tokens",
            PrefixMode::Approximate => "approximate",
            PrefixMode::None => "none",
        }
    }
}

/// A request's prompt as blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptBlocks {
    pub mode: PrefixMode,
    pub locals: Vec<LocalBlockHash>,
    pub hashes: Vec<SequenceHash>,
    /// Prompt length in tokens (estimated in approximate mode).
    pub isl_tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvSettings {
    /// Tokens per KV block (the engines' `block_size`): the starting value when learned.
    pub block_size: u32,
    /// Take the block size from the engines' `cache_config_info` ([`KvState::learn_block_size`]).
    pub learn_block_size: bool,
    pub weights: CostWeights,
    /// Approximate mode: bytes of prompt counted as one token (a block is `block_size` of them).
    pub approx_bytes_per_token: u32,
    /// Approximate mode: blocks remembered per endpoint.
    pub approx_blocks_per_endpoint: usize,
    /// Upper bound of (block, rank) pairs per rank in the index.
    pub max_blocks_per_rank: u64,
    /// Match every prompt (token ids and tokenized ones too) against what was routed, never
    /// against the KV-event index: approximate prefix routing.
    pub approximate_only: bool,
    /// Key of the indexes' table hasher; servers pass a random one (prompts are untrusted).
    pub table_seed: u64,
    /// The engines hold prefix-closed block sets (they evict leaves first, as vLLM and SGLang
    /// do), so lookups in the KV-event index may search for where holders change instead of
    /// reading every matched block ([`super::index::PrefixIndex::find_matches_jumping`]).
    pub prefix_closed: bool,
}

impl Default for KvSettings {
    fn default() -> Self {
        KvSettings {
            block_size: 16,
            learn_block_size: false,
            weights: CostWeights::default(),
            approx_bytes_per_token: 4,
            approx_blocks_per_endpoint: 32_768,
            max_blocks_per_rank: super::index::DEFAULT_MAX_BLOCKS_PER_RANK,
            approximate_only: false,
            table_seed: super::index::DEFAULT_TABLE_SEED,
            prefix_closed: true,
        }
    }
}

/// What the predicted-TTFT model reads for one candidate: the prefill queued there plus this
/// prompt's uncached part, the decoding KV (with this request's), the engine's hidden requests.
fn ttft_features(
    w: &CostWeights,
    bs: u32,
    isl: u64,
    c: &CandidateLoad,
    load: &EndpointLoad,
) -> TtftFeatures {
    let own = w.effective_prefill_tokens(isl, bs, c.overlap);
    let queued = c.potential_prefill_tokens.saturating_sub(isl);
    TtftFeatures {
        uncached_ktokens: own as f64 / 1000.0,
        prefill_ktokens: (queued + own) as f64 / 1000.0,
        decode_ktokens: c.potential_decode_blocks as f64 * f64::from(bs) / 1000.0,
        hidden_requests: f64::from(load.hidden_requests()),
    }
}

/// Tries of a pick whose booking found the chosen rank's load changed since the pick read it:
/// the last one books regardless (the router's picks) or reads and books under one write lock
/// (the HTTP services' select-and-reserve).
pub const BOOKING_ATTEMPTS: usize = 4;

/// The worker id of an endpoint (stable across discovery updates).
pub fn worker_id(addr: &str) -> u64 {
    xxh3_64(addr.as_bytes())
}

/// What the picker decided for the chosen candidate (logged at debug level, booked).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvDecision {
    pub mode: PrefixMode,
    /// Full KV blocks in the prompt.
    pub prompt_blocks: u64,
    pub overlap: Overlap,
    pub cost: f64,
    pub effective_prefill_tokens: u64,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u32,
    /// The chosen rank's load version when it was read (None: not registered yet): a booking
    /// checked against it books exactly the load this decision saw.
    pub load_version: Option<u64>,
    /// Under the `predicted_ttft` cost model: what the chosen endpoint's prediction read (its
    /// booking learns from the observed first token).
    pub ttft: Option<TtftFeatures>,
}

/// Blocks we routed, per endpoint, for approximate mode: a FIFO of references per endpoint in a
/// prefix index. Only the blocks beyond the prefix the endpoint already held get references, so a
/// prompt routed again costs what it adds; a hot prefix ages out after `cap` newer blocks and is
/// recorded again by the next request that routes it.
#[derive(Debug)]
struct Approx {
    index: SharedIndex,
    fifo: Mutex<HashMap<u64, VecDeque<SequenceHash>>>,
    cap: usize,
}

impl Approx {
    /// Records `p`'s leading blocks (at most `cap`) after the first `held` as routed to `worker`,
    /// first evicting the oldest references so they fit: the rank's distinct blocks never exceed
    /// its references, so the index always has room and the FIFO keeps learning under pressure.
    fn record(&self, worker: u64, p: &PromptBlocks, held: usize) {
        let rank = WorkerRank { worker, dp_rank: 0 };
        let n = p.hashes.len().min(self.cap);
        let skip = held.min(n);
        if skip == n {
            // Everything is there already: no write, so readers and other writers never wait.
            return;
        }
        let mut fifos = lock(&self.fifo);
        let fifo = fifos.entry(worker).or_default();
        let evict = (fifo.len() + n - skip)
            .saturating_sub(self.cap)
            .min(fifo.len());
        let evicted: Vec<SequenceHash> = fifo.drain(..evict).collect();
        let parent = skip.checked_sub(1).map(|i| EngineBlockHash(p.hashes[i].0));
        let stored = self.index.write(|ix| {
            ix.remove(
                rank,
                Tier::Device,
                evicted.iter().map(|h| EngineBlockHash(h.0)),
            );
            let blocks = p.hashes[skip..n]
                .iter()
                .zip(&p.locals[skip..n])
                .map(|(s, l)| (EngineBlockHash(s.0), *l));
            // Cannot be full after the eviction above. A refusal (full, or the held prefix
            // evicted meanwhile by another record) only loses this request's blocks, never leaks
            // index entries outside the FIFO.
            ix.store(rank, Tier::Device, parent, blocks).unwrap_or(0)
        });
        fifo.extend(p.hashes[skip..skip + stored].iter().copied());
    }

    /// How many leading blocks of `p` the approximate index holds for `worker`.
    fn held(&self, worker: u64, p: &PromptBlocks) -> usize {
        self.index
            .read()
            .overlaps(&p.hashes)
            .iter()
            .find(|o| o.rank.worker == worker && o.rank.dp_rank == 0)
            .map_or(0, |o| o.overlap.device as usize)
    }

    /// Forgets `workers`' routed blocks (index and FIFOs together).
    fn forget(&self, workers: &[u64]) {
        let mut fifos = lock(&self.fifo);
        self.index.write(|ix| {
            for &w in workers {
                ix.remove_worker(w);
            }
        });
        fifos.retain(|w, _| !workers.contains(w));
    }
}

/// Told about every booking the KV-aware picker makes and ends, and every prompt it records as
/// routed in approximate mode (replica sync publishes them to the other replicas). Called after
/// the state's locks are released; implementations must not block.
pub trait BookingObserver: Send + Sync + std::fmt::Debug {
    /// A pick booked `id` (a process-local id) on `rank`.
    fn admitted(
        &self,
        id: &str,
        rank: WorkerRank,
        block_size: u32,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
    );
    fn prefill_complete(&self, id: &str);
    fn freed(&self, id: &str);
    /// Approximate mode: the prompt's blocks were recorded as routed to `worker`.
    fn routed(&self, worker: u64, prompt: &PromptBlocks);
}

/// Shared state of the KV-aware picker: the index fed by KV events, the approximate index, and
/// the slot tracker.
#[derive(Debug)]
pub struct KvState {
    settings: KvSettings,
    index: SharedIndex,
    approx: Approx,
    slots: RwLock<SlotTracker>,
    next_request: AtomicU64,
    /// Bookings refused because the chosen rank's load changed after the pick read it.
    booking_conflicts: AtomicU64,
    block_size: AtomicU32,
    /// The engines' base model (from their metadata): any other model name is a LoRA adapter.
    base_model: RwLock<Option<Arc<str>>>,
    /// Pick buffers, reused: a few pools so concurrent picks rarely meet on one lock.
    scratch: [Mutex<Vec<PickScratch>>; SCRATCH_POOLS],
    /// Set once at startup when replica sync runs.
    observer: std::sync::OnceLock<Arc<dyn BookingObserver>>,
    /// The pool's TTFT model (the `predicted_ttft` cost).
    ttft: TtftModel,
    /// Recent token prompts' block hashes (a next turn hashes only its new blocks).
    memo: PrefixMemo,
}

const SCRATCH_POOLS: usize = 8;

/// Which of an endpoint's `hints.index` remembers its slot in which index.
const HINT_EVENT_INDEX: usize = 0;
const HINT_APPROX_INDEX: usize = 1;

/// Worker id → candidate index for one pick: open addressing over reused arrays (no hashing of
/// addresses, no allocation once grown).
#[derive(Debug, Default)]
struct CandidateMap {
    keys: Vec<u64>,
    /// Candidate index + 1; 0: empty.
    vals: Vec<u32>,
    len: usize,
}

impl CandidateMap {
    fn slot(&self, key: u64) -> usize {
        // Worker ids are already hashes of the address: one multiply spreads them.
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & (self.keys.len() - 1)
    }

    fn clear(&mut self) {
        if self.len > 0 {
            self.vals.fill(0);
            self.len = 0;
        }
    }

    fn build(&mut self, workers: impl ExactSizeIterator<Item = u64>) {
        let cap = (workers.len() * 2).next_power_of_two().max(16);
        if self.keys.len() != cap {
            self.keys = vec![0; cap];
            self.vals = vec![0; cap];
        }
        let mask = cap - 1;
        for (i, w) in workers.enumerate() {
            let mut at = self.slot(w);
            while self.vals[at] != 0 && self.keys[at] != w {
                at = (at + 1) & mask;
            }
            if self.vals[at] == 0 {
                self.keys[at] = w;
                self.vals[at] = i as u32 + 1;
                self.len += 1;
            }
        }
    }

    fn get(&self, w: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mask = self.keys.len() - 1;
        let mut at = self.slot(w);
        loop {
            match self.vals[at] {
                0 => return None,
                v if self.keys[at] == w => return Some(v as usize - 1),
                _ => at = (at + 1) & mask,
            }
        }
    }
}

/// Reusable buffers of one pick (taken from and returned to a pool, so a pick allocates none of
/// them in steady state).
#[derive(Debug, Default)]
struct PickScratch {
    matching: MatchScratch,
    found: Vec<RankOverlap>,
    /// The walk over the slot tracker's active blocks.
    held: HeldScratch,
    /// The ranks' loads, copied out of the slot tracker.
    views: Vec<RankView>,
    /// Candidate index by worker id (the first candidate of a worker).
    by_worker: CandidateMap,
    /// Per candidate: best cached overlap over its worker's ranks (where ranks other than 0
    /// exist).
    best: Vec<Overlap>,
    /// Per candidate, under the predicted-TTFT cost only (Dynamo's keeps just the costs and
    /// reads the chosen one's load again).
    loads: Vec<CandidateLoad>,
    versions: Vec<Option<u64>>,
    costs: Vec<f64>,
    /// Candidates whose tracker hint missed, with the load resolved for them under the lock.
    resolved: Vec<(usize, CandidateLoad, Option<u64>)>,
}

/// What one pick's walks left for reading a candidate's load ([`KvState::load_of`]).
struct Walked {
    index: Option<arc_swap::Guard<Arc<super::index::PrefixIndex>>>,
    /// Which of an endpoint's index hints the index read uses.
    hint: usize,
    /// The index has data-parallel ranks other than 0: overlaps were gathered per worker.
    per_worker: bool,
    blocks: u64,
    isl: u64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(PoisonError::into_inner)
}

impl KvState {
    pub fn new(settings: KvSettings) -> Self {
        KvState {
            settings,
            index: SharedIndex::with_seed(settings.max_blocks_per_rank, settings.table_seed),
            approx: Approx {
                index: SharedIndex::with_seed(
                    settings.approx_blocks_per_endpoint as u64,
                    settings.table_seed,
                ),
                fifo: Mutex::new(HashMap::new()),
                cap: settings.approx_blocks_per_endpoint,
            },
            slots: RwLock::new(SlotTracker::with_seed(
                super::slots::STALE_REQUEST_AFTER,
                settings.table_seed,
            )),
            next_request: AtomicU64::new(0),
            booking_conflicts: AtomicU64::new(0),
            block_size: AtomicU32::new(settings.block_size.max(1)),
            base_model: RwLock::new(None),
            scratch: Default::default(),
            observer: std::sync::OnceLock::new(),
            ttft: TtftModel::default(),
            memo: PrefixMemo::default(),
        }
    }

    pub fn settings(&self) -> &KvSettings {
        &self.settings
    }

    /// Installs the observer of bookings (once; false if one was already installed).
    pub fn observe(&self, observer: Arc<dyn BookingObserver>) -> bool {
        self.observer.set(observer).is_ok()
    }

    /// Approximate mode: records a prompt's blocks as routed to `worker` (a peer replica's pick).
    pub fn record_routed(
        &self,
        worker: u64,
        locals: Vec<LocalBlockHash>,
        hashes: Vec<SequenceHash>,
    ) {
        let p = PromptBlocks {
            mode: PrefixMode::Approximate,
            locals,
            hashes,
            isl_tokens: 0,
        };
        let held = self.approx.held(worker, &p);
        self.approx.record(worker, &p, held);
    }

    /// Bookings refused (and picked again) because the chosen rank's load changed between the
    /// pick and its booking.
    /// The pool's TTFT model (shared coefficients; speeds are per endpoint).
    pub fn ttft_model(&self) -> &TtftModel {
        &self.ttft
    }

    pub fn booking_conflicts(&self) -> u64 {
        self.booking_conflicts.load(Ordering::Relaxed)
    }

    /// Tokens per block used for hashing and cost (configured, or learned from the engines).
    pub fn block_size(&self) -> u32 {
        self.block_size.load(Ordering::Relaxed)
    }

    /// An engine reported its block size; adopted when the block size is learned, not configured.
    pub fn learn_block_size(&self, bs: u32) {
        if !self.settings.learn_block_size || bs == 0 {
            return;
        }
        let old = self.block_size.swap(bs, Ordering::Relaxed);
        if old != bs {
            tracing::info!(
                block_size = bs,
                previous = old,
                "block size learned from the engines' cache_config_info"
            );
        }
    }

    /// The index the KV events feed ([`SharedIndex::write`] for events, [`SharedIndex::read`]
    /// for picks and inspection).
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    /// An engine reported its base model name.
    pub fn learn_base_model(&self, name: &str) {
        let mut base = self
            .base_model
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if base.as_deref() != Some(name) {
            tracing::info!(model = name, "base model learned from engine metadata");
            *base = Some(name.into());
        }
    }

    /// The LoRA adapter a request for `model` runs with: the model itself when a base model is
    /// known and differs from it (vLLM serves adapters under their own names), else none.
    pub fn lora_for(&self, model: &str) -> Option<Arc<str>> {
        let base = self
            .base_model
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        match base.as_deref() {
            Some(b) if b != model => Some(model.into()),
            _ => None,
        }
    }

    /// Blocks of a tokenized prompt (Dynamo's hashes, LoRA-seeded); in approximate-only mode they
    /// are matched against what was routed.
    pub fn blocks_from_tokens(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        mode: PrefixMode,
    ) -> PromptBlocks {
        let (locals, hashes) = self.memo.hashes(tokens, self.block_size() as usize, lora);
        PromptBlocks {
            mode: if self.settings.approximate_only {
                PrefixMode::Approximate
            } else {
                mode
            },
            locals,
            hashes,
            isl_tokens: tokens.len() as u64,
        }
    }

    /// Approximate blocks of a prompt's bytes: chained xxh3 over blocks of
    /// `block_size × approx_bytes_per_token` bytes, seeded by `scope` (the model).
    pub fn blocks_from_text(&self, scope: &str, text: &[u8]) -> PromptBlocks {
        let per_token = self.settings.approx_bytes_per_token.max(1) as usize;
        let chunk = (self.block_size() as usize) * per_token;
        let seed = block_seed(Some(scope)) ^ XXH3_SEED;
        let n = text.len() / chunk;
        let mut locals = Vec::with_capacity(n);
        let mut hashes = Vec::with_capacity(n);
        for block in text.chunks_exact(chunk) {
            let local = LocalBlockHash(xxh3_64_with_seed(block, seed));
            let seq = SequenceHash::chain(hashes.last().copied(), local);
            locals.push(local);
            hashes.push(seq);
        }
        PromptBlocks {
            mode: PrefixMode::Approximate,
            locals,
            hashes,
            isl_tokens: (text.len() / per_token) as u64,
        }
    }

    /// Takes a pick's buffers from a pool (`hint` spreads concurrent picks over the pools).
    fn take_scratch(&self, hint: usize) -> (usize, PickScratch) {
        for k in 0..SCRATCH_POOLS {
            let pool = (hint + k) % SCRATCH_POOLS;
            if let Ok(mut v) = self.scratch[pool].try_lock() {
                if let Some(s) = v.pop() {
                    return (pool, s);
                }
                return (pool, PickScratch::default());
            }
        }
        (hint % SCRATCH_POOLS, PickScratch::default())
    }

    fn return_scratch(&self, pool: usize, s: PickScratch) {
        let mut v = lock(&self.scratch[pool]);
        if v.len() < 4 {
            v.push(s);
        }
    }

    /// Walks `hashes` into `scratch` over the index their mode reads (the approximate one, or
    /// the KV-event one, jumping where the engines' block sets are prefix-closed) and returns
    /// that index, for reading the runs.
    fn walk_index(
        &self,
        hashes: &[SequenceHash],
        approximate: bool,
        scratch: &mut MatchScratch,
    ) -> arc_swap::Guard<Arc<super::index::PrefixIndex>> {
        let ix = if approximate {
            self.approx.index.read()
        } else {
            self.index.read()
        };
        ix.walk(hashes, scratch, self.settings.prefix_closed && !approximate);
        ix
    }

    /// The KV-event index's overlaps of `hashes` into `sc.found`.
    fn event_matches(&self, hashes: &[SequenceHash], sc: &mut PickScratch) {
        self.walk_index(hashes, false, &mut sc.matching)
            .walked_all(&sc.matching, &mut sc.found);
    }

    /// Walks the indexes and the slot tracker for `prompt`, then fills `sc.costs` (Dynamo's
    /// formula, with `dynamo`'s weights, block size and per-candidate bias), or without
    /// `dynamo` `sc.loads` and `sc.versions` (overlap, projected load and its version per
    /// candidate, in order) for the caller's own cost.
    ///
    /// Each walk (KV or approximate index, then the slot tracker's trie) leaves its results in
    /// scratch space indexed by dense ids, and the ranks' loads are copied beside them under the
    /// tracker's read lock; a candidate reads its own through the hints kept in its endpoint, so
    /// the cost per candidate is a few array reads, without the lock. Only where an index has
    /// data-parallel ranks other than 0 (whose best run counts for the endpoint) are the runs
    /// gathered per worker instead. Candidates whose tracker hint misses (first picks,
    /// re-registrations) are resolved afterwards under the lock, into `sc.resolved`.
    fn candidate_loads(
        &self,
        candidates: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        dynamo: Option<(&CostWeights, u32, &[f64])>,
        sc: &mut PickScratch,
    ) -> Walked {
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        let approximate = prompt.is_some_and(|p| p.mode == PrefixMode::Approximate);
        let cost = |i: usize, c: &CandidateLoad| {
            dynamo.map(|(w, bs, bias)| w.cost(bs, c) + bias.get(i).copied().unwrap_or(0.0))
        };
        let index =
            (!hashes.is_empty()).then(|| self.walk_index(hashes, approximate, &mut sc.matching));
        let per_worker = index.as_ref().is_some_and(|ix| ix.has_nonzero_dp_ranks());
        let walked = Walked {
            index,
            hint: if approximate {
                HINT_APPROX_INDEX
            } else {
                HINT_EVENT_INDEX
            },
            per_worker,
            blocks: hashes.len() as u64,
            isl,
        };
        if per_worker {
            if let Some(ix) = &walked.index {
                ix.walked_all(&sc.matching, &mut sc.found);
            }
            self.best_per_worker(candidates, sc);
        }
        // The slot tracker's read lock covers one walk and one copy of the ranks' loads, not
        // the pass over the candidates: bookings wait as little as possible (the indexes are
        // snapshots, read without a lock).
        {
            let slots = read(&self.slots);
            slots.walk_held(hashes, &mut sc.held);
            slots.views_into(&mut sc.views);
        }
        sc.loads.clear();
        sc.versions.clear();
        sc.costs.clear();
        sc.resolved.clear();
        for (i, e) in candidates.iter().enumerate() {
            let found = Self::load_of(&walked, sc, i, e);
            // A miss's placeholders are replaced below.
            let (c, version) = found.map_or_else(
                || {
                    sc.resolved.push((i, CandidateLoad::default(), None));
                    (CandidateLoad::default(), None)
                },
                |(c, v)| (c, Some(v)),
            );
            match cost(i, &c) {
                Some(cost) => sc.costs.push(cost),
                None => {
                    sc.loads.push(c);
                    sc.versions.push(version);
                }
            }
        }
        if !sc.resolved.is_empty() {
            let slots = read(&self.slots);
            let mut resolved = std::mem::take(&mut sc.resolved);
            for (i, c, v) in &mut resolved {
                let Some(e) = candidates.get(*i) else {
                    continue;
                };
                let rank = WorkerRank {
                    worker: e.worker,
                    dp_rank: 0,
                };
                let found = slots.dense_id(rank).and_then(|id| {
                    e.hints.slot.store(id, Ordering::Relaxed);
                    project(&sc.views, &sc.held, rank, id, walked.blocks, isl)
                });
                // An unregistered rank (or one registered since the copy) counts as idle;
                // booking registers it.
                let (l, version) = found.map_or_else(
                    || (slots.projection(rank, walked.blocks, 0, isl).0, None),
                    |(l, v)| (l, Some(v)),
                );
                c.overlap = Self::overlap_of(&walked, sc, *i, e);
                c.set_load(&l);
                *v = version;
                match cost(*i, c) {
                    Some(cost) => {
                        if let Some(slot) = sc.costs.get_mut(*i) {
                            *slot = cost;
                        }
                    }
                    None => {
                        if let (Some(slot), Some(version)) =
                            (sc.loads.get_mut(*i), sc.versions.get_mut(*i))
                        {
                            *slot = *c;
                            *version = *v;
                        }
                    }
                }
            }
            sc.resolved = resolved;
        }
        walked
    }

    /// Candidate `i`'s cached prefix, from the walks.
    #[inline(always)]
    fn overlap_of(w: &Walked, sc: &PickScratch, i: usize, e: &Endpoint) -> Overlap {
        match &w.index {
            _ if w.per_worker => sc.best.get(i).copied().unwrap_or_default(),
            Some(ix) => ix
                .walked(
                    &sc.matching,
                    WorkerRank {
                        worker: e.worker,
                        dp_rank: 0,
                    },
                    &e.hints.index[w.hint],
                )
                .unwrap_or_default(),
            None => Overlap::default(),
        }
    }

    /// Candidate `i`'s overlap and projected load with its load version, from the walks and the
    /// copied views; None: its tracker hint missed.
    #[inline(always)]
    fn load_of(
        w: &Walked,
        sc: &PickScratch,
        i: usize,
        e: &Endpoint,
    ) -> Option<(CandidateLoad, u64)> {
        let rank = WorkerRank {
            worker: e.worker,
            dp_rank: 0,
        };
        let slot = e.hints.slot.load(Ordering::Relaxed);
        let (l, version) = project(&sc.views, &sc.held, rank, slot, w.blocks, w.isl)?;
        let mut c = CandidateLoad {
            overlap: Self::overlap_of(w, sc, i, e),
            ..CandidateLoad::default()
        };
        c.set_load(&l);
        Some((c, version))
    }

    /// After [`Self::candidate_loads`]: candidate `i`'s load and version as its cost read them.
    fn chosen_load(
        w: &Walked,
        sc: &PickScratch,
        i: usize,
        e: &Endpoint,
    ) -> (CandidateLoad, Option<u64>) {
        if let (Some(c), Some(v)) = (sc.loads.get(i), sc.versions.get(i)) {
            return (*c, *v);
        }
        if let Some(&(_, c, v)) = sc.resolved.iter().find(|r| r.0 == i) {
            return (c, v);
        }
        Self::load_of(w, sc, i, e).map_or((CandidateLoad::default(), None), |(c, v)| (c, Some(v)))
    }

    /// `sc.best[i]`: candidate `i`'s best cached prefix over its worker's ranks, from the runs
    /// in `sc.found` (a worker named twice reads what its first candidate got).
    fn best_per_worker(&self, candidates: &[Arc<Endpoint>], sc: &mut PickScratch) {
        sc.best.clear();
        sc.best.resize(candidates.len(), Overlap::default());
        sc.by_worker.clear();
        if sc.found.is_empty() {
            return;
        }
        sc.by_worker.build(candidates.iter().map(|e| e.worker));
        for o in &sc.found {
            if let Some(i) = sc.by_worker.get(o.rank.worker) {
                let cur = &mut sc.best[i];
                cur.device = cur.device.max(o.overlap.device);
                cur.host = cur.host.max(o.overlap.host);
                cur.disk = cur.disk.max(o.overlap.disk);
            }
        }
        for (i, e) in candidates.iter().enumerate() {
            if let Some(first) = sc.by_worker.get(e.worker).filter(|&f| f != i) {
                sc.best[i] = sc.best[first];
            }
        }
    }

    /// Ranks candidates: the chosen one, the next cheapest, and the decision for the chosen one.
    pub fn rank(
        &self,
        candidates: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
    ) -> (usize, Option<usize>, KvDecision) {
        // Any per-thread-ish number spreads picks over the buffer pools; the stack address is.
        let hint = (std::ptr::from_ref(ctx) as usize) >> 8;
        let (pool, mut sc) = self.take_scratch(hint);
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        let w = &self.settings.weights;
        let bs = self.block_size();
        let predicted = w.cost_model == CostModel::PredictedTtft;
        let dynamo = (!predicted).then_some((w, bs, &ctx.bias[..]));
        let walked = self.candidate_loads(candidates, prompt, dynamo, &mut sc);
        if predicted {
            let now = super::load::clock_nanos(ctx.now);
            sc.costs.extend(sc.loads.iter().enumerate().map(|(i, c)| {
                let load = &candidates[i].load;
                let f = ttft_features(w, bs, isl, c, load);
                self.ttft.cost(&load.ttft, &f, now) + ctx.bias.get(i).copied().unwrap_or(0.0)
            }));
        }
        let costs = &sc.costs;
        // Equal costs (e.g. requests without a full block of prompt) go to the endpoint with
        // fewer requests in flight, then at random: load must still spread when the cost is blind.
        let in_flight = |i: usize| candidates[i].load.in_flight();
        let (best, second) = w.choose_two(costs, in_flight, &mut ctx.rng);
        if let Some(scores) = &mut ctx.scores {
            // Costs are non-negative block counts: 1 / (1 + cost) keeps the order, in (0, 1].
            scores.clear();
            scores.extend(costs.iter().map(|c| 1.0 / (1.0 + c.max(0.0))));
        }
        let (c, load_version) = Self::chosen_load(&walked, &sc, best, &candidates[best]);
        drop(walked);
        let decision = KvDecision {
            mode: prompt.map_or(PrefixMode::None, |p| p.mode),
            prompt_blocks: hashes.len() as u64,
            overlap: c.overlap,
            cost: costs[best],
            effective_prefill_tokens: w.effective_prefill_tokens(isl, bs, c.overlap),
            potential_prefill_tokens: c.potential_prefill_tokens,
            potential_decode_blocks: c.potential_decode_blocks,
            active_requests: c.active_requests,
            load_version,
            ttft: predicted.then(|| ttft_features(w, bs, isl, &c, &candidates[best].load)),
        };
        self.return_scratch(pool, sc);
        (best, second, decision)
    }

    /// Books the request on the endpoint: slot-tracker load until the guard drops, and in
    /// approximate mode the prompt's blocks as routed there.
    pub fn book(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        prompt: Option<&PromptBlocks>,
        effective_prefill_tokens: u64,
        now: Instant,
    ) -> SlotGuard {
        let booked = self.book_inner(endpoint, prompt, effective_prefill_tokens, 0, None, now);
        booked.unwrap_or_else(|| SlotGuard {
            state: self.clone(),
            id: None,
            prefill_done: false,
            learn: None,
        })
    }

    /// Books what `decision` decided on `endpoint`, but only if the endpoint's load is still the
    /// one the decision read; None (nothing booked): pick again.
    pub fn book_decision(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        prompt: Option<&PromptBlocks>,
        decision: &KvDecision,
        now: Instant,
    ) -> Option<SlotGuard> {
        let booked = self
            .book_inner(
                endpoint,
                prompt,
                decision.effective_prefill_tokens,
                decision.overlap.device,
                Some(decision.load_version.unwrap_or(0)),
                now,
            )
            .map(|mut g| {
                g.learn = decision.ttft.map(|f| (endpoint.load.ttft.clone(), f, now));
                g
            });
        if booked.is_none() {
            self.booking_conflicts.fetch_add(1, Ordering::Relaxed);
        }
        booked
    }

    fn book_inner(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        prompt: Option<&PromptBlocks>,
        effective_prefill_tokens: u64,
        held: u64,
        expected: Option<u64>,
        now: Instant,
    ) -> Option<SlotGuard> {
        let worker = endpoint.worker;
        let rank = WorkerRank { worker, dp_rank: 0 };
        // A NUL-led id: never one a client of the HTTP services can have booked.
        let id = format!("\0{}", self.next_request.fetch_add(1, Ordering::Relaxed));
        let hashes = prompt.map_or(&[][..], |p| &p.hashes[..]);
        let booked = {
            let mut slots = write(&self.slots);
            slots.register(rank);
            slots.add_if_unchanged(&id, rank, hashes, effective_prefill_tokens, now, expected)
        };
        match booked {
            Ok(false) => return None,
            Ok(true) => {
                if let Some(o) = self.observer.get() {
                    o.admitted(
                        &id,
                        rank,
                        self.block_size(),
                        hashes,
                        effective_prefill_tokens,
                    );
                }
            }
            Err(_) => {}
        }
        if let Some(p) = prompt.filter(|p| p.mode == PrefixMode::Approximate) {
            self.approx.record(worker, p, held as usize);
            if let Some(o) = self.observer.get() {
                o.routed(worker, p);
            }
        }
        Some(SlotGuard {
            state: self.clone(),
            id: booked.is_ok().then_some(id),
            prefill_done: false,
            learn: None,
        })
    }

    /// Drops bookings older than the stale-request limit at `now` (requests whose end was never
    /// seen). Called periodically, off the pick path; returns how many.
    pub fn expire_stale(&self, now: Instant) -> usize {
        write(&self.slots).expire(now)
    }

    /// Forgets an endpoint that left the pool (index, approximate index, load).
    pub fn forget(&self, addr: &str) {
        self.remove_worker(worker_id(addr));
    }

    /// Forgets every worker that `keep` rejects, wherever it appears (KV-event index, approximate
    /// index, slot tracker); returns how many were forgotten. Unlike [`KvState::forget`] it needs
    /// no record of departures: whatever is not live goes.
    pub fn retain_workers(&self, keep: impl Fn(u64) -> bool) -> usize {
        let mut gone: std::collections::HashSet<u64> = self.index.read().workers();
        gone.extend(lock(&self.approx.fifo).keys().copied());
        gone.extend(self.approx.index.read().workers());
        gone.extend(read(&self.slots).ranks().map(|r| r.worker));
        gone.retain(|&w| !keep(w));
        let gone: Vec<u64> = gone.into_iter().collect();
        self.remove_workers(&gone);
        gone.len()
    }

    /// Active load of an endpoint (rank 0).
    pub fn load(&self, addr: &str) -> Option<super::slots::RankLoad> {
        read(&self.slots).load(WorkerRank {
            worker: worker_id(addr),
            dp_rank: 0,
        })
    }
}

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
    Slot(#[from] super::slots::SlotError),
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
    ) -> Vec<super::slots::PotentialLoad> {
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
    fn remove_workers(&self, workers: &[u64]) {
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
    ) -> Result<(), super::slots::SlotError> {
        write(&self.slots).add(id, rank, hashes, prefill_tokens, now)
    }

    pub fn prefill_complete(&self, id: &str) -> Result<(), super::slots::SlotError> {
        write(&self.slots).prefill_complete(id)
    }

    pub fn output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), super::slots::SlotError> {
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
    pub fn rank_loads(&self) -> Vec<(WorkerRank, super::slots::RankLoad)> {
        read(&self.slots).loads().collect()
    }

    /// Requests the slot tracker holds on `worker`'s rank 0 (the rank the picker books):
    /// this process's bookings and, with replica sync, its peers'. None: not registered.
    pub fn worker_requests(&self, worker: u64) -> Option<u32> {
        let rank = WorkerRank { worker, dp_rank: 0 };
        read(&self.slots).load(rank).map(|l| l.active_requests)
    }
}

/// One request's slot-tracker booking: prefill until [`SlotGuard::first_byte`], freed on drop.
#[derive(Debug)]
pub struct SlotGuard {
    state: Arc<KvState>,
    /// The slot tracker's request id (None when booking failed).
    id: Option<String>,
    prefill_done: bool,
    /// A pick by predicted TTFT: the endpoint's speed, what the prediction read, when booked.
    learn: Option<(Arc<EndpointSpeed>, TtftFeatures, Instant)>,
}

impl SlotGuard {
    /// The first token arrived at `now`: the endpoint's TTFT model learns what it took. Once.
    pub fn first_token(&mut self, now: Instant) {
        if let Some((speed, f, at)) = self.learn.take() {
            let ms = now.saturating_duration_since(at).as_secs_f64() * 1000.0;
            self.state.ttft.observe(&speed, &f, ms, now);
        }
    }

    pub fn first_byte(&mut self) {
        if let (Some(id), false) = (&self.id, self.prefill_done) {
            self.prefill_done = true;
            let _ = write(&self.state.slots).prefill_complete(id);
            if let Some(o) = self.state.observer.get() {
                o.prefill_complete(id);
            }
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(id) = &self.id {
            write(&self.state.slots).free(id);
            if let Some(o) = self.state.observer.get() {
                o.freed(id);
            }
        }
    }
}

/// [`super::Picker`] over [`KvState`].
#[derive(Debug, Clone)]
pub struct KvPicker(pub Arc<KvState>);

impl super::Picker for KvPicker {
    fn rank(
        &self,
        candidates: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
    ) -> super::Ranked {
        let (best, second, kv) = self.0.rank(candidates, prompt, ctx);
        super::Ranked {
            best,
            second,
            kv: Some(kv),
        }
    }
}

#[cfg(test)]
mod pick_tests;
