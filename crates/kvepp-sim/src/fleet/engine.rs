//! One simulated engine's scheduler: continuous batching in real time, as vLLM's V1 scheduler
//! runs it.
//!
//! Each step first gives every decoding sequence room for the token it computes (a new KV block
//! when its last one is full; when none is free or evictable, the most recently admitted sequence
//! is preempted: its blocks are released and it waits at the head of the queue, to recompute its
//! prompt and output so far, from the prefix cache where it can). Then waiting requests are
//! admitted first come first served while `max_num_seqs` allows and their prompt's blocks fit
//! (none in a step that preempted). Within `max_num_batched_tokens`, the step computes one token
//! per decoding sequence and prompt chunks first come first served (chunked prefill). It lasts
//! `step_overhead + prefill × prompt tokens (+ attention over their context) + decode × decoding
//! sequences + KV reads × their total context`, and its tokens reach the clients when it ends.
//! Generated tokens are [`generated_token`]s of the prompt, cached as their blocks fill.
//!
//! LoRA adapters (`max_loras` > 0): a request for an adapter is admitted only when the adapter
//! holds one of the engine's `max_loras` GPU slots; one not loaded takes a free slot, or evicts the
//! least recently used adapter no running request uses, and loading it stalls that step by
//! `lora_load_ms`; when every slot's adapter is in use the request is skipped (others behind it
//! go first), as vLLM's scheduler does.
//!
//! A restart ([`Command::Restart`]) drops every request (their clients see the response end),
//! empties the pool and publishes `AllBlocksCleared` under new sequence numbers.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::cache::{generated_token, generation_seed, CacheEvent, Holding, KvPool, NoRoom};
use super::SimParams;

/// What the engine sends back for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// `n` more output tokens (the first one ends the prompt's prefill).
    Tokens(u32),
    /// The request is done.
    Finished(Usage),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// A request handed to the scheduler.
#[derive(Debug)]
pub struct Job {
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    pub out: mpsc::UnboundedSender<Output>,
    /// The prompt's KV cache came from a prefill engine, which had this many of its tokens
    /// cached: only the last token is computed here, and the usage reports the prefill engine's
    /// cached tokens.
    pub remote_cached_tokens: Option<u64>,
    /// The LoRA adapter it runs with (None: the base model).
    pub adapter: Option<Arc<str>>,
}

/// What the scheduler is told.
#[derive(Debug)]
pub enum Command {
    Job(Job),
    /// The engine process restarts: requests dropped, cache empty, events numbered from 0.
    Restart,
}

/// Live counters (what `/metrics` shows).
#[derive(Debug, Default)]
pub struct Counters {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished: AtomicU64,
    pub aborted: AtomicU64,
    pub preemptions: AtomicU64,
    pub restarts: AtomicU64,
    /// Adapters loaded into a GPU slot, and those evicted to make room.
    pub lora_loads: AtomicU64,
    pub lora_evictions: AtomicU64,
    /// Prompt tokens sent to the engine and not computed yet (queued, or in a prompt not yet
    /// prefilled), less the cached prefix once admission found it: what a clairvoyant placement
    /// reads (`bench::oracle`). Raised as the HTTP front takes a request, not at the next step.
    pub prefill_backlog: AtomicU64,
    /// Tokens of context the decoding sequences read at the last step.
    pub decode_context: AtomicU64,
}

impl Counters {
    /// `n` more prompt tokens to compute.
    pub fn add_backlog(&self, n: u64) {
        self.prefill_backlog.fetch_add(n, Ordering::Relaxed);
    }

    /// `n` prompt tokens computed (or found cached, or dropped); never below zero.
    pub fn take_backlog(&self, n: u64) {
        let _ = self
            .prefill_backlog
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(n))
            });
    }
}

/// Adapters of running requests, and of waiting ones (each sorted, without repeats).
pub type AdapterLists = (Vec<Arc<str>>, Vec<Arc<str>>);

/// A request waiting for admission: new, or preempted with `generated` tokens already sent.
struct Pending {
    job: Job,
    seed: u64,
    generated: u32,
    /// The cached tokens its first admission found (what its usage reports).
    cached_tokens: Option<u64>,
}

impl Pending {
    /// The tokens its admission computes, as the backlog counts them until then.
    fn backlog(&self) -> u64 {
        self.job.tokens.len() as u64 + u64::from(self.generated)
    }

    fn new(job: Job) -> Self {
        Pending {
            seed: generation_seed(&job.tokens),
            job,
            generated: 0,
            cached_tokens: None,
        }
    }
}

struct Seq {
    p: Pending,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Tokens (prompt and, after a preemption, output so far) still to compute.
    prefill_left: u64,
    /// Tokens whose KV is computed (the context of the next prefill chunk).
    computed: u64,
    unsent: u32,
    holding: Holding,
}

/// The scheduler's shared parts: the KV pool (also read by `/debug/cache`) and the counters.
#[derive(Debug)]
pub struct EngineCore {
    pub params: SimParams,
    pub cache: Mutex<KvPool>,
    pub counters: Counters,
    /// The adapters of running and of waiting requests (what `vllm:lora_requests_info` shows).
    pub adapters: Mutex<AdapterLists>,
}

impl EngineCore {
    pub fn new(params: SimParams) -> Arc<Self> {
        Arc::new(EngineCore {
            cache: Mutex::new(KvPool::new(
                params.block_size as usize,
                params.total_kv_blocks as usize,
            )),
            counters: Counters::default(),
            adapters: Mutex::default(),
            params,
        })
    }

    pub fn cache(&self) -> parking_lot::MutexGuard<'_, KvPool> {
        self.cache.lock()
    }
}

/// The scheduler's state between steps.
struct Scheduler {
    core: Arc<EngineCore>,
    events: mpsc::UnboundedSender<Vec<CacheEvent>>,
    waiting: VecDeque<Pending>,
    /// In admission order: the last is the first preempted.
    running: Vec<Seq>,
    /// Adapters in GPU slots, with when each was last used.
    loaded: Vec<(Arc<str>, u64)>,
    tick: u64,
    /// Adapter loading to add to the next step (µs).
    load_us: f64,
}

impl Scheduler {
    fn publish(&self, events: Vec<CacheEvent>) {
        if !events.is_empty() {
            let _ = self.events.send(events);
        }
    }

    fn command(&mut self, c: Command) {
        match c {
            Command::Job(j) => self.waiting.push_back(Pending::new(j)),
            Command::Restart => {
                let n = self.running.len() + self.waiting.len();
                let dropped: u64 = self.running.iter().map(|q| q.prefill_left).sum::<u64>()
                    + self.waiting.iter().map(Pending::backlog).sum::<u64>();
                self.running.clear();
                self.waiting.clear();
                let c = &self.core.counters;
                c.take_backlog(dropped);
                c.aborted.fetch_add(n as u64, Ordering::Relaxed);
                c.restarts.fetch_add(1, Ordering::Relaxed);
                self.loaded.clear();
                let ev = self.core.cache().clear();
                self.publish(ev);
            }
        }
    }

    /// Releases the last admitted sequence's blocks and puts it back at the head of the queue.
    fn preempt_last(&mut self) {
        if let Some(s) = self.running.pop() {
            self.core.cache().release(s.holding);
            self.core
                .counters
                .preemptions
                .fetch_add(1, Ordering::Relaxed);
            let mut p = s.p;
            // Admission again computes the prompt and the output so far, less what it finds cached.
            let resumed = p.job.tokens.len() as u64 + u64::from(p.generated);
            self.core.counters.add_backlog(resumed);
            p.cached_tokens = Some(s.cached_tokens);
            self.waiting.push_front(p);
        }
    }

    /// Room for the token each decoding sequence computes this step, preempting from the end;
    /// whether any was preempted.
    fn grow_decoding(&mut self) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            if s.prefill_left > 0 || s.p.generated == 0 {
                i += 1;
                continue;
            }
            // The KV of the last token sent is computed now.
            let token = generated_token(s.p.seed, s.p.generated - 1);
            let grown = self.core.cache().grow(&mut s.holding, token);
            match grown {
                Ok(ev) => {
                    self.publish(ev);
                    i += 1;
                }
                Err(NoRoom) => {
                    preempted = true;
                    self.preempt_last();
                }
            }
        }
        preempted
    }

    /// Whether `adapter` holds a GPU slot, loading it (into a free slot, or evicting the least
    /// recently used adapter no running request uses) when it does not; false when every slot's
    /// adapter is in use.
    fn lora_slot(&mut self, adapter: &Arc<str>) -> bool {
        self.tick += 1;
        let tick = self.tick;
        if let Some(l) = self.loaded.iter_mut().find(|(n, _)| n == adapter) {
            l.1 = tick;
            return true;
        }
        let c = &self.core.counters;
        if self.loaded.len() >= self.core.params.max_loras as usize {
            let running = &self.running;
            let busy = |n: &Arc<str>| running.iter().any(|s| s.p.job.adapter.as_ref() == Some(n));
            let victim = self
                .loaded
                .iter()
                .enumerate()
                .filter(|(_, (n, _))| !busy(n))
                .min_by_key(|(_, (_, t))| *t)
                .map(|(i, _)| i);
            let Some(i) = victim else { return false };
            self.loaded.swap_remove(i);
            c.lora_evictions.fetch_add(1, Ordering::Relaxed);
        }
        self.loaded.push((adapter.clone(), tick));
        self.load_us += self.core.params.lora_load_ms * 1000.0;
        c.lora_loads.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// First come first served while a slot and the prompt's blocks are free; a request whose
    /// adapter gets no GPU slot is passed over for now.
    fn admit(&mut self) {
        let max_seqs = self.core.params.max_num_seqs;
        let mut i = 0;
        while self.running.len() < max_seqs && i < self.waiting.len() {
            if self.waiting[i].job.out.is_closed() {
                let backlog = self.waiting[i].backlog();
                self.core.counters.take_backlog(backlog);
                self.waiting.remove(i);
                self.core.counters.aborted.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Some(a) = self.waiting[i].job.adapter.clone() {
                if !self.lora_slot(&a) {
                    i += 1;
                    continue;
                }
            }
            let front = &self.waiting[i];
            // A preempted request recomputes its output so far too.
            let resumed: Vec<u32>;
            let tokens = if front.generated > 0 {
                resumed = front
                    .job
                    .tokens
                    .iter()
                    .copied()
                    .chain((0..front.generated).map(|i| generated_token(front.seed, i)))
                    .collect();
                &resumed[..]
            } else {
                &front.job.tokens[..]
            };
            let admitted = self
                .core
                .cache()
                .admit_lora(tokens, front.job.adapter.clone());
            let adm = match admitted {
                Ok(a) => a,
                Err(NoRoom) if self.running.is_empty() => {
                    // It cannot fit even alone (the HTTP front refuses such requests).
                    tracing::warn!(
                        tokens = tokens.len(),
                        "request larger than the KV cache dropped"
                    );
                    self.core.counters.take_backlog(tokens.len() as u64);
                    self.waiting.remove(i);
                    self.core.counters.aborted.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                Err(NoRoom) => break,
            };
            let total = tokens.len() as u64;
            let Some(pending) = self.waiting.remove(i) else {
                break;
            };
            self.start(pending, adm, total);
        }
    }

    /// Runs an admitted request: its cache events out, its counters in, a running sequence.
    fn start(&mut self, pending: Pending, adm: super::cache::Admission, total: u64) {
        self.publish(adm.events);
        let c = &self.core.counters;
        let remote = pending.job.remote_cached_tokens;
        let first = pending.cached_tokens.is_none();
        if first {
            c.prompt_tokens.fetch_add(total, Ordering::Relaxed);
            c.cached_tokens
                .fetch_add(adm.cached_tokens, Ordering::Relaxed);
        }
        // At least the last token is computed; a remote prefill's cache arrived whole.
        let prefill_left = if remote.is_some() && first {
            1
        } else {
            (total - adm.cached_tokens).max(1)
        };
        c.take_backlog(total - prefill_left);
        self.running.push(Seq {
            prompt_tokens: pending.job.tokens.len() as u64,
            cached_tokens: pending
                .cached_tokens
                .or(remote)
                .unwrap_or(adm.cached_tokens),
            computed: total - prefill_left,
            prefill_left,
            unsent: 0,
            holding: adm.holding,
            p: pending,
        });
    }

    /// Removes the sequences that generated all their tokens (their usage to the client) or whose
    /// client went away.
    fn finish_done(&mut self) {
        let c = &self.core.counters;
        let mut i = 0;
        while i < self.running.len() {
            let q = &self.running[i];
            let aborted = q.p.generated == u32::MAX;
            if !aborted && q.p.generated < q.p.job.max_tokens.max(1) {
                i += 1;
                continue;
            }
            let q = self.running.remove(i);
            self.core.cache().release(q.holding);
            if aborted {
                c.take_backlog(q.prefill_left);
                c.aborted.fetch_add(1, Ordering::Relaxed);
            } else {
                c.finished.fetch_add(1, Ordering::Relaxed);
                let _ = q.p.job.out.send(Output::Finished(Usage {
                    prompt_tokens: q.prompt_tokens,
                    cached_tokens: q.cached_tokens,
                    completion_tokens: u64::from(q.p.generated),
                }));
            }
        }
    }

    fn publish_counters(&self) {
        let c = &self.core.counters;
        c.running
            .store(self.running.len() as u64, Ordering::Relaxed);
        c.waiting
            .store(self.waiting.len() as u64, Ordering::Relaxed);
        if self.core.params.max_loras > 0 {
            let distinct = |it: &mut dyn Iterator<Item = &Option<Arc<str>>>| {
                let mut v: Vec<Arc<str>> = it.flatten().cloned().collect();
                v.sort();
                v.dedup();
                v
            };
            let running = distinct(&mut self.running.iter().map(|s| &s.p.job.adapter));
            let waiting = distinct(&mut self.waiting.iter().map(|p| &p.job.adapter));
            *self.core.adapters.lock() = (running, waiting);
        }
    }
}

/// Runs the scheduler until `commands` closes; cache changes go to `events` as they happen.
pub async fn run(
    core: Arc<EngineCore>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    events: mpsc::UnboundedSender<Vec<CacheEvent>>,
) {
    let p = core.params.clone();
    let bs = p.block_size.max(1) as usize;
    let mut s = Scheduler {
        core: core.clone(),
        events,
        waiting: VecDeque::new(),
        running: Vec::new(),
        loaded: Vec::new(),
        tick: 0,
        load_us: 0.0,
    };
    let mut deadline = Instant::now();
    loop {
        if s.running.is_empty() && s.waiting.is_empty() {
            match commands.recv().await {
                Some(c) => s.command(c),
                None => return,
            }
            deadline = Instant::now();
        }
        while let Ok(c) = commands.try_recv() {
            s.command(c);
        }
        let preempted = s.grow_decoding();
        if !preempted {
            s.admit();
        }
        s.publish_counters();
        if s.running.is_empty() {
            continue;
        }

        // One step: decodes first, then prompt chunks within the token budget.
        let decoding: Vec<usize> = (0..s.running.len())
            .filter(|&i| s.running[i].prefill_left == 0)
            .collect();
        let context: u64 = decoding
            .iter()
            .map(|&i| s.running[i].holding.tokens(bs) as u64)
            .sum();
        core.counters
            .decode_context
            .store(context, Ordering::Relaxed);
        let mut budget = p.max_num_batched_tokens.max(1);
        budget = budget.saturating_sub(decoding.len() as u64);
        let (mut prefilled, mut attended) = (0u64, 0.0f64);
        let mut finishing_prefill = Vec::new();
        for (i, q) in s.running.iter_mut().enumerate() {
            if q.prefill_left == 0 || budget == 0 {
                continue;
            }
            let take = q.prefill_left.min(budget);
            core.counters.take_backlog(take);
            // Each token of the chunk attends to the context before it.
            attended += take as f64 * (q.computed as f64 + take as f64 / 2.0);
            q.prefill_left -= take;
            q.computed += take;
            budget -= take;
            prefilled += take;
            if q.prefill_left == 0 {
                finishing_prefill.push(i);
            }
        }
        let step_us = p.step_overhead_us
            + std::mem::take(&mut s.load_us)
            + p.prefill_us_per_token * prefilled as f64
            + p.prefill_us_per_token_per_kctx * attended / 1000.0
            + p.decode_us_per_seq * decoding.len() as f64
            + p.decode_us_per_kctx * context as f64 / 1000.0;
        deadline += Duration::from_nanos((step_us * 1000.0) as u64);
        let now = Instant::now();
        if now > deadline + Duration::from_millis(50) {
            // Fell far behind (CPU starved): do not burst to catch up.
            deadline = now;
        }
        tokio::time::sleep_until(deadline).await;

        // The step's tokens: one per decoding sequence, the first for each finished prompt (a
        // resumed request goes on where it stopped).
        let mut emitted = 0u64;
        for (i, q) in s.running.iter_mut().enumerate() {
            let first = finishing_prefill.binary_search(&i).is_ok();
            if !first && q.prefill_left > 0 {
                continue;
            }
            q.p.generated += 1;
            q.unsent += 1;
            emitted += 1;
            let done = q.p.generated >= q.p.job.max_tokens.max(1);
            if first || done || q.unsent >= p.stream_interval.max(1) {
                let n = std::mem::take(&mut q.unsent);
                if q.p.job.out.send(Output::Tokens(n)).is_err() {
                    q.p.generated = u32::MAX; // client gone: abort below
                }
            }
        }
        core.counters
            .generation_tokens
            .fetch_add(emitted, Ordering::Relaxed);
        s.finish_done();
        s.publish_counters();
    }
}
