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
//! Modes, per request ([`PrefixMode`]): `token_ids` (the completions prompt was token ids),
//! `tokens` (tokenized by us), `approximate` (no tokenizer: hashes of fixed-size byte blocks of
//! the prompt, matched against what we routed before, per endpoint, bounded FIFO of blocks) and
//! `none` (no prompt: load only).
//!
//! Every endpoint is one worker (`worker_id` of its address) with rank 0 for load; its cached
//! prefix is the best over the data-parallel ranks its events came from.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::cost::{CandidateLoad, CostWeights, Overlap};
use super::index::{EngineBlockHash, MatchScratch, PrefixIndex, RankOverlap, Tier};
use super::slots::{SlotTracker, WorkerRank};
use super::{Endpoint, PickContext};
use crate::hash::{
    block_seed, local_block_hashes, sequence_hashes, LocalBlockHash, SequenceHash, XXH3_SEED,
};

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
        }
    }
}

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
}

/// Blocks we routed, per endpoint, for approximate mode: a FIFO of references per endpoint in a
/// prefix index (a block routed again gets a new reference, so recently used blocks live longer).
#[derive(Debug)]
struct Approx {
    index: PrefixIndex,
    fifo: HashMap<u64, VecDeque<SequenceHash>>,
    cap: usize,
}

impl Approx {
    /// Records `p`'s leading blocks (at most `cap`) as routed to `worker`, first evicting the
    /// oldest references so they fit: the rank's distinct blocks never exceed its references,
    /// so the index always has room and the FIFO keeps learning under pressure.
    fn record(&mut self, worker: u64, p: &PromptBlocks) {
        let rank = WorkerRank { worker, dp_rank: 0 };
        let n = p.hashes.len().min(self.cap);
        let fifo = self.fifo.entry(worker).or_default();
        while fifo.len() + n > self.cap {
            let Some(old) = fifo.pop_front() else { break };
            self.index
                .remove(rank, Tier::Device, [EngineBlockHash(old.0)]);
        }
        let blocks = p
            .hashes
            .iter()
            .zip(&p.locals)
            .take(n)
            .map(|(s, l)| (EngineBlockHash(s.0), *l));
        // Cannot be full after the eviction above; a refusal would only lose this request's
        // blocks, never leak index entries outside the FIFO.
        let stored = self
            .index
            .store(rank, Tier::Device, None, blocks)
            .unwrap_or(0);
        fifo.extend(p.hashes.iter().take(stored));
    }

    fn forget(&mut self, worker: u64) {
        self.index.remove_worker(worker);
        self.fifo.remove(&worker);
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
    index: RwLock<PrefixIndex>,
    approx: Mutex<Approx>,
    slots: Mutex<SlotTracker>,
    next_request: AtomicU64,
    block_size: AtomicU32,
    /// The engines' base model (from their metadata): any other model name is a LoRA adapter.
    base_model: RwLock<Option<Arc<str>>>,
    /// Lookup buffers, one per pick in progress at most.
    scratch: Mutex<Vec<Scratch>>,
    /// Set once at startup when replica sync runs.
    observer: std::sync::OnceLock<Arc<dyn BookingObserver>>,
}

/// Reusable buffers of one index lookup (taken from and returned to a small pool, so a pick
/// allocates none of them in steady state).
type Scratch = (MatchScratch, Vec<RankOverlap>);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl KvState {
    pub fn new(settings: KvSettings) -> Self {
        KvState {
            settings,
            index: RwLock::new(PrefixIndex::with_seed(
                settings.max_blocks_per_rank,
                settings.table_seed,
            )),
            approx: Mutex::new(Approx {
                index: PrefixIndex::with_seed(
                    settings.approx_blocks_per_endpoint as u64,
                    settings.table_seed,
                ),
                fifo: HashMap::new(),
                cap: settings.approx_blocks_per_endpoint,
            }),
            slots: Mutex::new(SlotTracker::default()),
            next_request: AtomicU64::new(0),
            block_size: AtomicU32::new(settings.block_size.max(1)),
            base_model: RwLock::new(None),
            scratch: Mutex::new(Vec::new()),
            observer: std::sync::OnceLock::new(),
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
        lock(&self.approx).record(worker, &p);
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

    /// The index the KV events feed (write lock for events, read lock for picks).
    pub fn index(&self) -> &RwLock<PrefixIndex> {
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
        let locals = local_block_hashes(tokens, self.block_size() as usize, lora);
        let hashes = sequence_hashes(&locals);
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

    /// Per-candidate cached prefix (blocks), best over each worker's ranks.
    fn overlaps(&self, workers: &[u64], prompt: Option<&PromptBlocks>) -> Vec<Overlap> {
        let mut per = vec![Overlap::default(); workers.len()];
        let Some(p) = prompt.filter(|p| !p.hashes.is_empty()) else {
            return per;
        };
        let mut buffers = lock(&self.scratch).pop().unwrap_or_default();
        let (scratch, out) = &mut buffers;
        match p.mode {
            PrefixMode::Approximate => {
                lock(&self.approx)
                    .index
                    .find_matches(&p.hashes, scratch, out);
            }
            _ => self
                .index
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .find_matches(&p.hashes, scratch, out),
        }
        for o in out.iter() {
            if let Some(i) = workers.iter().position(|&w| w == o.rank.worker) {
                let cur = &mut per[i];
                cur.device = cur.device.max(o.overlap.device);
                cur.host = cur.host.max(o.overlap.host);
                cur.disk = cur.disk.max(o.overlap.disk);
            }
        }
        lock(&self.scratch).push(buffers);
        per
    }

    /// Ranks candidates: the chosen one, the next cheapest, and the decision for the chosen one.
    pub fn rank(
        &self,
        candidates: &[&Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        ctx: &mut PickContext,
    ) -> (usize, Option<usize>, KvDecision) {
        let workers: Vec<u64> = candidates.iter().map(|e| worker_id(&e.addr_str)).collect();
        let overlaps = self.overlaps(&workers, prompt);
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        let w = &self.settings.weights;
        let bs = self.block_size();
        let mut loads = Vec::with_capacity(candidates.len());
        {
            let slots = lock(&self.slots);
            for (&worker, &overlap) in workers.iter().zip(&overlaps) {
                // An unregistered rank counts as idle; booking registers it.
                let l = slots.potential_load(WorkerRank { worker, dp_rank: 0 }, hashes, isl);
                loads.push(CandidateLoad {
                    overlap,
                    potential_prefill_tokens: l.potential_prefill_tokens,
                    potential_decode_blocks: l.potential_decode_blocks,
                    active_requests: l.active_requests,
                });
            }
        }
        let costs: Vec<f64> = loads
            .iter()
            .enumerate()
            .map(|(i, c)| w.cost(bs, c) + ctx.bias.get(i).copied().unwrap_or(0.0))
            .collect();
        // Equal costs (e.g. requests without a full block of prompt) go to the endpoint with
        // fewer requests in flight, then at random: load must still spread when the cost is blind.
        let in_flight = |i: usize| candidates[i].load.in_flight();
        let best = w.choose_with_tiebreak(&costs, in_flight, &mut ctx.rng);
        let second = (0..costs.len()).filter(|&i| i != best).min_by(|&a, &b| {
            costs[a]
                .total_cmp(&costs[b])
                .then(in_flight(a).cmp(&in_flight(b)))
        });
        if let Some(scores) = &mut ctx.scores {
            // Costs are non-negative block counts: 1 / (1 + cost) keeps the order, in (0, 1].
            scores.clear();
            scores.extend(costs.iter().map(|c| 1.0 / (1.0 + c.max(0.0))));
        }
        let c = loads[best];
        let decision = KvDecision {
            mode: prompt.map_or(PrefixMode::None, |p| p.mode),
            prompt_blocks: hashes.len() as u64,
            overlap: c.overlap,
            cost: costs[best],
            effective_prefill_tokens: w.effective_prefill_tokens(isl, bs, c.overlap),
            potential_prefill_tokens: c.potential_prefill_tokens,
            potential_decode_blocks: c.potential_decode_blocks,
            active_requests: c.active_requests,
        };
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
        let worker = worker_id(&endpoint.addr_str);
        let rank = WorkerRank { worker, dp_rank: 0 };
        if let Some(p) = prompt.filter(|p| p.mode == PrefixMode::Approximate) {
            lock(&self.approx).record(worker, p);
            if let Some(o) = self.observer.get() {
                o.routed(worker, p);
            }
        }
        // A NUL-led id: never one a client of the HTTP services can have booked.
        let id = format!("\0{}", self.next_request.fetch_add(1, Ordering::Relaxed));
        let hashes = prompt.map_or(&[][..], |p| &p.hashes[..]);
        let booked = {
            let mut slots = lock(&self.slots);
            slots.register(rank);
            slots
                .add(&id, rank, hashes, effective_prefill_tokens, now)
                .is_ok()
        };
        if let (true, Some(o)) = (booked, self.observer.get()) {
            o.admitted(
                &id,
                rank,
                self.block_size(),
                hashes,
                effective_prefill_tokens,
            );
        }
        SlotGuard {
            state: self.clone(),
            id: booked.then_some(id),
            prefill_done: false,
        }
    }

    /// Drops bookings older than the stale-request limit at `now` (requests whose end was never
    /// seen). Called periodically, off the pick path; returns how many.
    pub fn expire_stale(&self, now: Instant) -> usize {
        lock(&self.slots).expire(now)
    }

    /// Forgets an endpoint that left the pool (index, approximate index, load).
    pub fn forget(&self, addr: &str) {
        self.remove_worker(worker_id(addr));
    }

    /// Forgets every worker that `keep` rejects, wherever it appears (KV-event index, approximate
    /// index, slot tracker); returns how many were forgotten. Unlike [`KvState::forget`] it needs
    /// no record of departures: whatever is not live goes.
    pub fn retain_workers(&self, keep: impl Fn(u64) -> bool) -> usize {
        let mut gone: std::collections::HashSet<u64> = self
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .workers();
        {
            let approx = lock(&self.approx);
            gone.extend(approx.fifo.keys().copied());
            gone.extend(approx.index.workers());
        }
        gone.extend(lock(&self.slots).ranks().map(|r| r.worker));
        gone.retain(|&w| !keep(w));
        if gone.is_empty() {
            return 0;
        }
        let mut index = self.index.write().unwrap_or_else(PoisonError::into_inner);
        let mut approx = lock(&self.approx);
        let mut slots = lock(&self.slots);
        for &w in &gone {
            index.remove_worker(w);
            approx.forget(w);
            slots.unregister_worker(w);
        }
        gone.len()
    }

    /// Active load of an endpoint (rank 0).
    pub fn load(&self, addr: &str) -> Option<super::slots::RankLoad> {
        lock(&self.slots).load(WorkerRank {
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
        let mut buffers = lock(&self.scratch).pop().unwrap_or_default();
        let (scratch, out) = &mut buffers;
        self.index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .find_matches(hashes, scratch, out);
        let found = out.clone();
        lock(&self.scratch).push(buffers);
        found
    }

    /// Chooses among `ranks` with the KV-aware cost (ties: fewer active requests, then at random)
    /// and, when `reserve` names a request, books it on the chosen rank under the same lock as
    /// the loads were read (atomic select-and-reserve). `found` is [`KvState::rank_overlaps`] of
    /// `hashes` (the caller keeps it for its own report). The ranks must be registered.
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
        let overlap_of = |r: WorkerRank| {
            found
                .iter()
                .find(|o| o.rank == r)
                .map_or(Overlap::default(), |o| o.overlap)
        };
        let w = &self.settings.weights;
        let bs = self.block_size();
        let mut slots = lock(&self.slots);
        let loads: Vec<CandidateLoad> = ranks
            .iter()
            .map(|&r| {
                let l = slots.potential_load(r, hashes, isl_tokens);
                CandidateLoad {
                    overlap: overlap_of(r),
                    potential_prefill_tokens: l.potential_prefill_tokens,
                    potential_decode_blocks: l.potential_decode_blocks,
                    active_requests: l.active_requests,
                }
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
        if let Some((id, now)) = reserve {
            slots.add(
                id,
                choice.rank,
                hashes,
                choice.effective_prefill_tokens,
                now,
            )?;
        }
        Ok(choice)
    }

    /// Each rank's load if it took this request (unregistered ranks count as idle).
    pub fn potential_loads(
        &self,
        ranks: &[WorkerRank],
        hashes: &[SequenceHash],
        isl_tokens: u64,
    ) -> Vec<super::slots::PotentialLoad> {
        let slots = lock(&self.slots);
        ranks
            .iter()
            .map(|&r| slots.potential_load(r, hashes, isl_tokens))
            .collect()
    }

    /// Makes a rank schedulable in the slot tracker (idempotent).
    pub fn register_rank(&self, rank: WorkerRank) {
        lock(&self.slots).register(rank);
    }

    /// Removes a worker's ranks, active requests and cached blocks.
    pub fn remove_worker(&self, worker: u64) {
        self.index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove_worker(worker);
        lock(&self.approx).forget(worker);
        lock(&self.slots).unregister_worker(worker);
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
        lock(&self.slots).add(id, rank, hashes, prefill_tokens, now)
    }

    pub fn prefill_complete(&self, id: &str) -> Result<(), super::slots::SlotError> {
        lock(&self.slots).prefill_complete(id)
    }

    pub fn output_block(
        &self,
        id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), super::slots::SlotError> {
        lock(&self.slots).add_output_block(id, decay_fraction)
    }

    /// Releases a reservation; whether it was active.
    pub fn free(&self, id: &str) -> bool {
        lock(&self.slots).free(id)
    }

    pub fn is_active(&self, id: &str) -> bool {
        lock(&self.slots).is_active(id)
    }

    /// Requests booked in the slot tracker.
    pub fn active_count(&self) -> usize {
        lock(&self.slots).active_count()
    }

    /// Every registered rank's load.
    pub fn rank_loads(&self) -> Vec<(WorkerRank, super::slots::RankLoad)> {
        lock(&self.slots).loads().collect()
    }
}

/// One request's slot-tracker booking: prefill until [`SlotGuard::first_byte`], freed on drop.
#[derive(Debug)]
pub struct SlotGuard {
    state: Arc<KvState>,
    /// The slot tracker's request id (None when booking failed).
    id: Option<String>,
    prefill_done: bool,
}

impl SlotGuard {
    pub fn first_byte(&mut self) {
        if let (Some(id), false) = (&self.id, self.prefill_done) {
            self.prefill_done = true;
            let _ = lock(&self.state.slots).prefill_complete(id);
            if let Some(o) = self.state.observer.get() {
                o.prefill_complete(id);
            }
        }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(id) = &self.id {
            lock(&self.state.slots).free(id);
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
        candidates: &[&Arc<Endpoint>],
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
