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
//! events (or another pick's routed blocks) being applied. The slot tracker ([`SharedSlots`]) has
//! no lock over the whole of it: a pick locks one shard of its active requests' trie, shared, for
//! its walk, and reads each candidate's load from its rank's published view without a lock; a
//! booking locks its request's id shard, the chosen rank's cell and its prompt's trie shard, and
//! books only if the rank's load is still the one the pick read (its version); otherwise the
//! router picks again. So select-and-book is atomic per decision while picks and bookings hardly
//! wait for one another.
//!
//! Cost of a pick over `n` candidates: one search of the KV-event index (a few dozen probes per
//! distinct set of holders along the prompt, however long its cached prefix: see
//! [`super::index::PrefixIndex::find_matches_jumping`]; the approximate index, whose FIFO evicts
//! prefixes first, is walked block by block), one walk down the slot tracker's trie, then O(1)
//! per candidate (the walks' results and its load, each found through a hint kept in the endpoint
//! beside its worker id), and O(n) arithmetic, in buffers reused from pick to pick. Under Dynamo's
//! cost at temperature 0 (no bias, bounded loads or scores), `ordered` costs only the holders its
//! bounds do not rule out and the least loaded by the slot tracker's load order, with the same
//! choice.
//!
//! Modes, per request ([`PrefixMode`]): `token_ids` (the completions prompt was token ids),
//! `tokens` (tokenized by us), `approximate` (no tokenizer: hashes of fixed-size byte blocks of
//! the prompt, matched against what we routed before, per endpoint, bounded FIFO of blocks) and
//! `none` (no prompt: load only).
//!
//! Every endpoint is one worker (`worker_id` of its address) with rank 0 for load; its cached
//! prefix is the best over the data-parallel ranks its events came from.
//!
//! Beside the pick here: `prompt` (a prompt's blocks), `scratch` (a pick's reused buffers),
//! `approx` (approximate mode's record of what was routed), `fallback` (endpoints whose events
//! are not read), `engine_reports` (block size, capacity, base model and events fallback as the
//! engines report them), `ranks` (the rank-level operations the HTTP services and replica sync
//! call), `ordered` and `roster` (ordered picks), `ttft` (what the predicted-TTFT cost reads) and
//! `guard` (a booking held for a request's life).

use parking_lot::{Mutex, RwLock};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub use super::cost::KvDecision;
use super::cost::{BoundInput, CandidateLoad, CostWeights, Overlap};
use super::index::{MatchScratch, RankOverlap, SharedIndex};
use super::load::EndpointLoad;
use super::predict::{TtftFeatures, TtftModel};
use super::slots::{SharedSlots, WorkerRank};
use super::{Endpoint, PickContext, PickRequest};
use crate::hash::{LocalBlockHash, PrefixMemo, SequenceHash};
use crate::listen::{Admitted, Hub};
pub use crate::types::worker_id;

mod approx;
mod engine_reports;
mod fallback;
mod guard;
use guard::local_id;
mod ordered;
mod prompt;
mod ranks;
mod roster;
mod scratch;
mod ttft;

use approx::Approx;
pub use engine_reports::capacity_limit;
use fallback::Fallback;
pub use fallback::FallbackReason;
pub use guard::SlotGuard;
pub use prompt::{PrefixMode, PromptBlocks};

use scratch::PickScratch;
use ttft::{decode_features, ttft_features};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvSettings {
    /// Tokens per KV block (the engines' `block_size`): the starting value when learned.
    pub block_size: u32,
    /// Take the block size from the engines' metrics pages and KV events
    /// ([`KvState::learn_block_size`]).
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
            block_size: crate::types::DEFAULT_BLOCK_SIZE,
            learn_block_size: false,
            weights: CostWeights::dynamo(),
            approx_bytes_per_token: 4,
            approx_blocks_per_endpoint: 32_768,
            max_blocks_per_rank: super::index::DEFAULT_MAX_BLOCKS_PER_RANK,
            approximate_only: false,
            table_seed: super::index::DEFAULT_TABLE_SEED,
            prefix_closed: true,
        }
    }
}

/// What a booking books in the slot tracker ([`KvState::book`]).
#[derive(Debug, Clone, Copy)]
pub struct SlotBooking<'a> {
    /// The slot tracker's id: a client's reservation id, or None for a process-local one.
    pub id: Option<&'a str>,
    /// Prefill tokens the request loads its rank with until its first byte.
    pub prefill_tokens: u64,
    /// Blocks of the prompt the rank holds (approximate mode records the rest as routed).
    pub held: u64,
    /// Book only if the rank's load is still this version; None: whatever it is.
    pub expected: Option<u64>,
    /// A pick by predicted TTFT: what its prediction read (the guard learns from the first token).
    pub learn: Option<TtftFeatures>,
    /// A pick by predicted completion: what its decode prediction read (the guard learns from
    /// the end of the response).
    pub decode: Option<crate::decode::DecodeFeatures>,
    /// The request's model (the decode model learns its output length).
    pub model: Option<&'a str>,
    pub now: Instant,
}

/// Shared state of the KV-aware picker: the index fed by KV events, the approximate index, and
/// the slot tracker.
#[derive(Debug)]
pub struct KvState {
    /// The settings at start; the cost weights among them change live ([`Self::set_weights`]).
    settings: KvSettings,
    /// The cost weights picks read now (each pick reads them once).
    weights: arc_swap::ArcSwap<CostWeights>,
    index: SharedIndex,
    approx: Approx,
    slots: SharedSlots,
    next_request: AtomicU64,
    /// Bookings refused because the chosen rank's load changed after the pick read it.
    booking_conflicts: AtomicU64,
    block_size: AtomicU32,
    /// The engines' base model (from their metadata): any other model name is a LoRA adapter.
    base_model: RwLock<Option<Arc<str>>>,
    /// Pick buffers, reused: a few pools so concurrent picks rarely meet on one lock.
    scratch: [Mutex<Vec<PickScratch>>; SCRATCH_POOLS],
    /// Who hears of this state's bookings (the router over it shares the hub).
    hub: Arc<Hub>,
    /// The pool's TTFT model (the `predicted_ttft` cost).
    ttft: TtftModel,
    /// The pool's decode model and learned output lengths (the `predicted_completion` cost).
    decode: crate::decode::DecodeModel,
    /// Recent token prompts' block hashes (a next turn hashes only its new blocks).
    memo: PrefixMemo,
    /// Recent approximate prompts' block hashes (the same, over a text's bytes).
    text_memo: PrefixMemo<u8>,
    /// Ordered picks' own state ([`ordered`]).
    ordered: roster::OrderedPicks,
    /// Workers whose KV events are not read ([`fallback`]): their cached prefix for token
    /// prompts is what was routed to them, as in approximate mode. Empty in steady state (one
    /// load per pick).
    fallback: Fallback,
}

const SCRATCH_POOLS: usize = 8;

/// Which of an endpoint's `hints.index` remembers its slot in which index.
const HINT_EVENT_INDEX: usize = 0;
const HINT_APPROX_INDEX: usize = 1;

/// What one pick's walks left for reading a candidate's load ([`KvState::load_of`]).
struct Walked {
    index: Option<arc_swap::Guard<Arc<super::index::PrefixIndex>>>,
    /// Which of an endpoint's index hints the index read uses.
    hint: usize,
    /// The index has data-parallel ranks other than 0: overlaps were gathered per worker.
    per_worker: bool,
    blocks: u64,
    isl: u64,
    /// Token prompts while some workers' events are in fallback: those workers (sorted), whose
    /// overlaps the pick read from the approximate index into `PickScratch::fallback`.
    fallback: Option<Arc<Vec<u64>>>,
    /// Speculative indexing ([`CostWeights::speculative`]) for a prompt matched against the
    /// KV-event index: a candidate's cached prefix is at least what its running requests hold.
    speculative: bool,
}

impl KvState {
    pub fn new(settings: KvSettings) -> Self {
        KvState {
            weights: arc_swap::ArcSwap::from_pointee(settings.weights),
            settings,
            index: SharedIndex::with_seed(settings.max_blocks_per_rank, settings.table_seed),
            approx: Approx::new(
                SharedIndex::with_seed(
                    settings.approx_blocks_per_endpoint as u64,
                    settings.table_seed,
                ),
                settings.approx_blocks_per_endpoint,
            ),
            slots: SharedSlots::with_seed(super::slots::STALE_REQUEST_AFTER, settings.table_seed),
            next_request: AtomicU64::new(0),
            booking_conflicts: AtomicU64::new(0),
            block_size: AtomicU32::new(settings.block_size.max(1)),
            base_model: RwLock::new(None),
            scratch: Default::default(),
            hub: Arc::default(),
            ttft: TtftModel::default(),
            decode: crate::decode::DecodeModel::default(),
            memo: PrefixMemo::default(),
            text_memo: PrefixMemo::default(),
            ordered: roster::OrderedPicks::default(),
            fallback: Fallback::default(),
        }
    }

    pub fn settings(&self) -> &KvSettings {
        &self.settings
    }

    /// The cost weights picks use now.
    pub fn weights(&self) -> CostWeights {
        **self.weights.load()
    }

    /// Replaces the cost weights (cost model, bounded loads, temperature …): picks that start
    /// afterwards use them; a pick under way keeps the ones it read.
    pub fn set_weights(&self, weights: CostWeights) {
        self.weights.store(Arc::new(weights));
    }

    /// Who hears of this state's bookings: admissions, prefill completions, frees, and in
    /// approximate mode the prompts recorded as routed.
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
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
            hashes: hashes.into(),
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

    /// The pool's decode model (shared coefficients) and learned output lengths.
    pub fn decode_model(&self) -> &crate::decode::DecodeModel {
        &self.decode
    }

    /// How prompts (token and approximate) got their block hashes: reused from a recent prompt,
    /// or hashed.
    pub fn prompt_hash_stats(&self) -> crate::hash::MemoStats {
        self.memo.stats() + self.text_memo.stats()
    }

    pub fn booking_conflicts(&self) -> u64 {
        self.booking_conflicts.load(Ordering::Relaxed)
    }

    /// Bookings whose path through the active requests' trie changed between its planning and
    /// its insertion ([`SharedSlots::stale_plans`]).
    pub fn stale_booking_plans(&self) -> u64 {
        self.slots.stale_plans()
    }

    /// Tokens per block used for hashing and cost (configured, or learned from the engines).
    pub fn block_size(&self) -> u32 {
        self.block_size.load(Ordering::Relaxed)
    }

    /// The index the KV events feed ([`SharedIndex::write`] for events, [`SharedIndex::read`]
    /// for picks and inspection).
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    /// Whether `model` names a LoRA adapter: a base model is known and `model` differs from it.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.base_model
            .read()
            .as_deref()
            .is_some_and(|b| b != model)
    }

    /// The LoRA adapter a request for `model` runs with: the model itself when a base model is
    /// known and differs from it (vLLM serves adapters under their own names), else none.
    pub fn lora_for(&self, model: &str) -> Option<Arc<str>> {
        self.is_adapter(model).then(|| model.into())
    }

    /// Takes a pick's buffers from a pool (`hint` spreads concurrent picks over the pools).
    fn take_scratch(&self, hint: usize) -> (usize, PickScratch) {
        for k in 0..SCRATCH_POOLS {
            let pool = (hint + k) % SCRATCH_POOLS;
            if let Some(mut v) = self.scratch[pool].try_lock() {
                if let Some(s) = v.pop() {
                    return (pool, s);
                }
                return (pool, PickScratch::default());
            }
        }
        (hint % SCRATCH_POOLS, PickScratch::default())
    }

    fn return_scratch(&self, pool: usize, s: PickScratch) {
        let mut v = self.scratch[pool].lock();
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
    /// scratch space indexed by dense ids; a candidate reads its own, and its rank's published
    /// load, through the hints kept in its endpoint, so the cost per candidate is a few array
    /// and atomic reads, without a lock. Only where an index has data-parallel ranks other than
    /// 0 (whose best run counts for the endpoint) are the runs gathered per worker instead.
    /// Candidates whose tracker hint misses (first picks, re-registrations) are resolved
    /// afterwards through the tracker's rank map, into `sc.resolved`.
    fn candidate_loads(
        &self,
        candidates: &[Arc<Endpoint>],
        prompt: Option<&PromptBlocks>,
        dynamo: Option<(&CostWeights, u32, &[f64])>,
        w: &CostWeights,
        sc: &mut PickScratch,
    ) -> Walked {
        let bound = w.bounds_loads();
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        let approximate = prompt.is_some_and(|p| p.mode == PrefixMode::Approximate);
        let cost = |i: usize, c: &CandidateLoad| {
            dynamo.map(|(w, bs, bias)| w.cost(bs, c) + bias.get(i).copied().unwrap_or(0.0))
        };
        let index =
            (!hashes.is_empty()).then(|| self.walk_index(hashes, approximate, &mut sc.matching));
        let per_worker = index.as_ref().is_some_and(|ix| ix.has_nonzero_dp_ranks());
        // Bounded loads on (`bound`): what they read is gathered only then.
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
            fallback: (!approximate && !hashes.is_empty())
                .then(|| self.fallback.workers())
                .filter(|f| !f.is_empty()),
            speculative: w.speculates() && !approximate && !hashes.is_empty(),
        };
        if let Some(f) = &walked.fallback {
            self.fallback_overlaps(hashes, f, sc);
        }
        if per_worker {
            if let Some(ix) = &walked.index {
                ix.walked_all(&sc.matching, &mut sc.found);
            }
            self.best_per_worker(candidates, sc);
        }
        // The slot tracker is read without a lock but the walk's (one trie shard's, shared):
        // each candidate's load is its rank's published view.
        self.slots.walk_held(hashes, &mut sc.held);
        sc.loads.clear();
        sc.versions.clear();
        sc.costs.clear();
        sc.requests.clear();
        sc.resolved.clear();
        for (i, e) in candidates.iter().enumerate() {
            let found = self.load_of(&walked, sc, i, e);
            // A miss's placeholders are replaced below.
            let (c, version) = found.map_or_else(
                || {
                    sc.resolved.push((i, CandidateLoad::default(), None));
                    (CandidateLoad::default(), None)
                },
                |(c, v)| (c, Some(v)),
            );
            if bound {
                sc.requests.push(Self::bound_input(&c, e));
            }
            match cost(i, &c) {
                Some(cost) => sc.costs.push(cost),
                None => {
                    sc.loads.push(c);
                    sc.versions.push(version);
                }
            }
        }
        if !sc.resolved.is_empty() {
            let slots = &self.slots;
            let mut resolved = std::mem::take(&mut sc.resolved);
            for (i, c, v) in &mut resolved {
                let Some(e) = candidates.get(*i) else {
                    continue;
                };
                let rank = e.rank();
                let dense = slots.dense_id(rank);
                let found = dense.and_then(|id| {
                    e.hints.slot.store(id, Ordering::Relaxed);
                    slots.project(&sc.held, rank, id, walked.blocks, isl)
                });
                // An unregistered rank counts as idle (read again: it may have registered since
                // the lookup); booking registers it.
                let (l, version) = found.map_or_else(
                    || (slots.projection(rank, walked.blocks, 0, isl).0, None),
                    |(l, v)| (l, Some(v)),
                );
                c.overlap = Self::overlap_of(&walked, sc, *i, e);
                if let Some(id) = dense.filter(|_| walked.speculative) {
                    Self::speculate(&mut c.overlap, sc.held.get(id as usize));
                }
                c.set_load(&l);
                *v = version;
                // Empty unless bounded loads are on.
                if let Some(r) = sc.requests.get_mut(*i) {
                    *r = Self::bound_input(c, e);
                }
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

    /// What bounded loads read of a candidate: the requests it holds (active in the slot
    /// tracker, plus those its engine reports beyond them), and the prompt's blocks it holds
    /// cached (which, against the other candidates', decides whether it is exempt).
    #[inline(always)]
    fn bound_input(c: &CandidateLoad, e: &Endpoint) -> BoundInput {
        BoundInput {
            requests: c.active_requests.saturating_add(e.load.hidden_requests()),
            cached: c.overlap.device,
        }
    }

    /// `sc.fallback`: the overlaps of `hashes` the approximate index holds for the workers in
    /// `fallback` (what was routed to them while their events do not decode).
    fn fallback_overlaps(&self, hashes: &[SequenceHash], fallback: &[u64], sc: &mut PickScratch) {
        sc.fallback.clear();
        let ix = self.approx.index.read();
        sc.fallback.extend(
            ix.overlaps(hashes)
                .into_iter()
                .filter(|o| o.rank.dp_rank == 0 && fallback.binary_search(&o.rank.worker).is_ok())
                .map(|o| (o.rank.worker, o.overlap)),
        );
    }

    /// Candidate `i`'s cached prefix, from the walks.
    #[inline(always)]
    fn overlap_of(w: &Walked, sc: &PickScratch, i: usize, e: &Endpoint) -> Overlap {
        if let Some(f) = &w.fallback {
            if f.binary_search(&e.worker).is_ok() {
                return sc
                    .fallback
                    .iter()
                    .find(|(worker, _)| *worker == e.worker)
                    .map_or_else(Overlap::default, |(_, o)| *o);
            }
        }
        match &w.index {
            // A rank-level candidate's prefix is its own rank's.
            _ if w.per_worker && e.exact_rank.is_none() => {
                sc.best.get(i).copied().unwrap_or_default()
            }
            Some(ix) => ix
                .walked(&sc.matching, e.rank(), &e.hints.index[w.hint])
                .unwrap_or_default(),
            None => Overlap::default(),
        }
    }

    /// Candidate `i`'s overlap and projected load with its load version, from the walks and its
    /// rank's published view; None: its tracker hint missed.
    #[inline(always)]
    fn load_of(
        &self,
        w: &Walked,
        sc: &PickScratch,
        i: usize,
        e: &Endpoint,
    ) -> Option<(CandidateLoad, u64)> {
        let rank = e.rank();
        let slot = e.hints.slot.load(Ordering::Relaxed);
        let (l, version) = self.slots.project(&sc.held, rank, slot, w.blocks, w.isl)?;
        let mut c = CandidateLoad {
            overlap: Self::overlap_of(w, sc, i, e),
            ..CandidateLoad::default()
        };
        if w.speculative {
            Self::speculate(&mut c.overlap, sc.held.get(slot as usize));
        }
        c.set_load(&l);
        Some((c, version))
    }

    /// Speculative indexing: the leading `running` blocks of the prompt that requests running on
    /// the candidate hold count as cached there (they are prefilled, or being prefilled, and stay
    /// resident while those requests run), whatever the engine's events have confirmed so far.
    #[inline(always)]
    fn speculate(overlap: &mut Overlap, running: u64) {
        overlap.device = overlap.device.max(running);
    }

    /// After [`Self::candidate_loads`]: candidate `i`'s load and version as its cost read them.
    fn chosen_load(
        &self,
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
        self.load_of(w, sc, i, e)
            .map_or((CandidateLoad::default(), None), |(c, v)| (c, Some(v)))
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
        req: &PickRequest<'_>,
        ctx: &mut PickContext,
    ) -> (usize, Option<usize>, KvDecision) {
        let prompt = req.prompt;
        // Any per-thread-ish number spreads picks over the buffer pools; the stack address is.
        let hint = (std::ptr::from_ref(ctx) as usize) >> 8;
        let (pool, mut sc) = self.take_scratch(hint);
        let (hashes, isl) = prompt.map_or((&[][..], 0), |p| (&p.hashes[..], p.isl_tokens));
        let weights = self.weights();
        let w = &weights;
        let bs = self.block_size();
        let predicting = self.predicting(w, req, ctx.now);
        let dynamo = predicting.is_none().then_some((w, bs, &ctx.bias[..]));
        let ordered = (self.ordered.on.load(Ordering::Relaxed)
            && Self::orderable(w, ctx.scores.is_some(), &ctx.bias)
            && self.fallback.is_empty())
        .then(|| {
            self.rank_ordered(
                candidates,
                (prompt, req.list),
                (w, bs),
                &mut ctx.rng,
                &mut sc,
            )
        })
        .flatten();
        self.ordered.paths.count(pool, ordered.is_some());
        if let Some(o) = ordered {
            self.return_scratch(pool, sc);
            let d = ordered::decision(prompt, (w, bs), &o.load, o.cost, Some(o.version));
            return (o.best, o.second, d);
        }
        let walked = self.candidate_loads(candidates, prompt, dynamo, w, &mut sc);
        let mut objective_filtered = false;
        if let Some(p) = &predicting {
            sc.missed.clear();
            for (i, c) in sc.loads.iter().enumerate() {
                let (cost, missed) = self.predicted(p, req, (w, bs, isl), c, &candidates[i].load);
                sc.costs
                    .push(cost + ctx.bias.get(i).copied().unwrap_or(0.0));
                if p.objectives {
                    sc.missed.push(missed);
                }
            }
            if p.objectives {
                // Candidates predicted to miss an objective are passed over while one meets them.
                let missed = &sc.missed;
                objective_filtered = crate::cost::pass_over(&mut sc.costs, |i| missed[i]);
            }
        }
        let load_bounded = w.bound_loads(&mut sc.costs, &sc.requests, hashes.len() as u64);
        let costs = &sc.costs;
        // Equal costs (e.g. requests without a full block of prompt, or new prefixes on idle
        // engines) go to the endpoint with fewer requests in flight, then to the one booked least
        // recently, then at random: load and new prefixes must still spread when the cost is blind.
        let in_flight = |i: usize| candidates[i].load.in_flight();
        let booked_at = |i: usize| candidates[i].load.booked_at();
        let (best, second) = w.choose_two(costs, in_flight, booked_at, &mut ctx.rng);
        if let Some(scores) = &mut ctx.scores {
            // Costs are non-negative block counts: 1 / (1 + cost) keeps the order, in (0, 1].
            scores.clear();
            scores.extend(costs.iter().map(|c| 1.0 / (1.0 + c.max(0.0))));
        }
        let (c, load_version) = self.chosen_load(&walked, &sc, best, &candidates[best]);
        drop(walked);
        let chosen = &candidates[best].load;
        let decision = KvDecision {
            load_bounded,
            objective_filtered,
            ttft: predicting.map(|_| ttft_features(w, bs, isl, &c, chosen)),
            decode: predicting.map(|p| decode_features(bs, isl, &c, chosen, p.output_tokens)),
            ..ordered::decision(prompt, (w, bs), &c, costs[best], load_version)
        };
        let decision = KvDecision {
            objective: self.outlook(
                &decision,
                predicting.as_ref(),
                candidates,
                best,
                &sc,
                (w, bs, isl),
            ),
            ..decision
        };
        self.return_scratch(pool, sc);
        (best, second, decision)
    }

    /// Books the request on `endpoint`'s rank: slot-tracker load until the guard drops, and in
    /// approximate mode the prompt's blocks as routed there. With `slot.expected`, only if the
    /// rank's load is still that version (what the pick read); `Ok(None)`: it changed, nothing was
    /// booked (the router picks again). An id the slot tracker holds already is refused.
    pub fn book(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        prompt: Option<&PromptBlocks>,
        slot: SlotBooking<'_>,
    ) -> Result<Option<SlotGuard>, crate::slots::SlotError> {
        let rank = endpoint.rank();
        let id: Arc<str> = match slot.id {
            Some(id) => id.into(),
            None => local_id(self.next_request.fetch_add(1, Ordering::Relaxed)),
        };
        let hashes = prompt.map_or(&[][..], |p| &p.hashes[..]);
        // Owned before the locks (they cover the trie and the counts only): the prompt's own
        // list, shared.
        let booking = super::slots::NewRequest {
            id: id.clone(),
            hashes: prompt.map_or_else(|| Arc::from([]), |p| p.hashes.clone()),
            new_isl_tokens: slot.prefill_tokens,
            now: slot.now,
        };
        // The endpoint's remembered dense id spares the rank map's lock on the booking path.
        let hint = self
            .slots
            .register_at(rank, endpoint.hints.slot.load(Ordering::Relaxed));
        if let Some(h) = hint {
            endpoint.hints.slot.store(h, Ordering::Relaxed);
        }
        let booked = self.slots.add_booking(booking, rank, slot.expected, hint);
        match booked {
            Ok(false) => {
                self.booking_conflicts.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Ok(true) => {
                let a = Admitted {
                    id: &id,
                    rank,
                    block_size: self.block_size(),
                    hashes,
                    prefill_tokens: slot.prefill_tokens,
                };
                self.hub.each(|l| l.admitted(&a));
            }
            Err(e) if slot.id.is_some() => return Err(e),
            // A process-local id cannot collide; the unknown-rank case cannot happen either
            // (registered above): book the load alone.
            Err(_) => {}
        }
        // Approximate prompts, and token prompts to an endpoint whose events do not decode,
        // are recorded as routed there.
        if let Some(p) = prompt.filter(|p| {
            p.mode == PrefixMode::Approximate
                || (p.mode != PrefixMode::None && self.in_events_fallback(endpoint.worker))
        }) {
            self.approx.record(endpoint.worker, p, slot.held as usize);
            self.hub.each(|l| l.routed(endpoint.worker, p));
        }
        Ok(Some(SlotGuard {
            state: self.clone(),
            id: booked.is_ok().then_some(id),
            prefill_done: false,
            learn: slot
                .learn
                .map(|f| (endpoint.load.ttft.clone(), f, slot.now)),
            decode: slot.decode.map(|f| (f, slot.model.map(Arc::from))),
            first_token_at: None,
        }))
    }

    /// Books what `decision` ([`Self::rank`]) decided on `endpoint`, only if its load is still the
    /// one the decision read (None: it changed). For benchmarks and tests that time or check the
    /// two halves of the router's transaction; front doors call [`crate::Router::route`].
    pub fn book_decision(
        self: &Arc<Self>,
        endpoint: &Endpoint,
        prompt: Option<&PromptBlocks>,
        decision: &KvDecision,
        now: Instant,
    ) -> Option<SlotGuard> {
        let slot = SlotBooking {
            id: None,
            prefill_tokens: decision.effective_prefill_tokens,
            held: decision.overlap.device,
            expected: Some(decision.load_version.unwrap_or(0)),
            learn: decision.ttft,
            decode: decision.decode,
            model: None,
            now,
        };
        self.book(endpoint, prompt, slot).ok().flatten()
    }

    /// Drops bookings older than the stale-request limit at `now` (requests whose end was never
    /// seen). Called periodically, off the pick path; returns how many.
    pub fn expire_stale(&self, now: Instant) -> usize {
        self.slots.expire(now)
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
        gone.extend(self.approx.workers());
        gone.extend(self.approx.index.read().workers());
        gone.extend(self.slots.ranks().iter().map(|r| r.worker));
        gone.retain(|&w| !keep(w));
        let gone: Vec<u64> = gone.into_iter().collect();
        self.remove_workers(&gone);
        gone.len()
    }

    /// Active load of an endpoint (rank 0).
    pub fn load(&self, addr: &str) -> Option<super::slots::RankLoad> {
        self.slots.load(WorkerRank {
            worker: worker_id(addr),
            dp_rank: 0,
        })
    }
}

/// [`super::Picker`] over [`KvState`].
#[derive(Debug, Clone)]
pub struct KvPicker(pub Arc<KvState>);

impl super::Picker for KvPicker {
    fn rank(
        &self,
        candidates: &[Arc<Endpoint>],
        req: &PickRequest<'_>,
        ctx: &mut PickContext,
    ) -> super::Ranked {
        let (best, second, kv) = self.0.rank(candidates, req, ctx);
        super::Ranked {
            best,
            second,
            kv: Some(kv),
        }
    }

    /// Predicted costs are in ms already. Dynamo's cost counts prefill blocks: a millisecond is
    /// the blocks the pool's TTFT model prefills in one (its prefill coefficient, 40 ms per
    /// thousand tokens to start, in the current block size).
    fn cost_per_ms(&self) -> Option<f64> {
        if self.0.weights().cost_model.predicts() {
            return Some(1.0);
        }
        let ms_per_ktoken = self.0.ttft.coefficients()[1].max(1e-3);
        Some(1000.0 / ms_per_ktoken / f64::from(self.0.block_size().max(1)))
    }
}

#[cfg(test)]
mod tests;
