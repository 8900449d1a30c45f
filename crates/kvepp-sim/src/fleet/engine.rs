//! One simulated engine's scheduler: continuous batching in real time.
//!
//! Each step serves, within `max_num_batched_tokens`, one decode token for every running sequence
//! whose prompt is done, then prompt chunks first come first served (chunked prefill). The step
//! lasts `step_overhead + prefill × prompt tokens + decode × decoding sequences` and its tokens
//! reach the clients when it ends. Sequences wait in a queue while `max_num_seqs` run or their KV
//! blocks (prompt + output) do not fit in `total_kv_blocks`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::cache::{CacheEvent, PrefixCache};
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
}

/// Live counters (what `/metrics` shows).
#[derive(Debug, Default)]
pub struct Counters {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    /// KV blocks held by running sequences.
    pub blocks_in_use: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished: AtomicU64,
    pub aborted: AtomicU64,
}

struct Seq {
    job: Job,
    prompt_tokens: u64,
    cached_tokens: u64,
    prefill_left: u64,
    generated: u32,
    unsent: u32,
    blocks: u64,
}

/// The scheduler's shared parts: the cache (also read by `/debug/cache`) and the counters.
#[derive(Debug)]
pub struct EngineCore {
    pub params: SimParams,
    pub cache: Mutex<PrefixCache>,
    pub counters: Counters,
}

impl EngineCore {
    pub fn new(params: SimParams) -> Arc<Self> {
        Arc::new(EngineCore {
            cache: Mutex::new(PrefixCache::new(
                params.block_size as usize,
                params.total_kv_blocks as usize,
            )),
            counters: Counters::default(),
            params,
        })
    }

    pub fn cache(&self) -> std::sync::MutexGuard<'_, PrefixCache> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(u64::from(self.params.block_size.max(1)))
    }
}

/// Runs the scheduler until `jobs` closes; cache changes go to `events` as they happen.
pub async fn run(
    core: Arc<EngineCore>,
    mut jobs: mpsc::UnboundedReceiver<Job>,
    events: mpsc::UnboundedSender<Vec<CacheEvent>>,
) {
    let p = core.params.clone();
    let c = &core.counters;
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut running: Vec<Seq> = Vec::new();
    let mut deadline = Instant::now();
    loop {
        if running.is_empty() && waiting.is_empty() {
            match jobs.recv().await {
                Some(j) => waiting.push_back(j),
                None => return,
            }
            deadline = Instant::now();
        }
        while let Ok(j) = jobs.try_recv() {
            waiting.push_back(j);
        }
        // Admission: first come first served while a slot and the KV blocks are free.
        while running.len() < p.max_num_seqs {
            let Some(front) = waiting.front() else { break };
            let need = core.blocks_for(front.tokens.len() as u64 + u64::from(front.max_tokens));
            let in_use = c.blocks_in_use.load(Ordering::Relaxed);
            if !running.is_empty() && in_use + need > p.total_kv_blocks {
                break;
            }
            let Some(job) = waiting.pop_front() else {
                break;
            };
            if job.out.is_closed() {
                c.aborted.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let adm = core.cache().admit(&job.tokens);
            if !adm.events.is_empty() {
                let _ = events.send(adm.events);
            }
            let prompt_tokens = job.tokens.len() as u64;
            c.prompt_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
            c.cached_tokens
                .fetch_add(adm.cached_tokens, Ordering::Relaxed);
            c.blocks_in_use.fetch_add(need, Ordering::Relaxed);
            running.push(Seq {
                prompt_tokens,
                cached_tokens: job.remote_cached_tokens.unwrap_or(adm.cached_tokens),
                // At least the last prompt token is computed.
                prefill_left: if job.remote_cached_tokens.is_some() {
                    1
                } else {
                    (prompt_tokens - adm.cached_tokens).max(1)
                },
                generated: 0,
                unsent: 0,
                blocks: need,
                job,
            });
        }
        c.running.store(running.len() as u64, Ordering::Relaxed);
        c.waiting.store(waiting.len() as u64, Ordering::Relaxed);

        // One step: decodes first, then prompt chunks within the token budget.
        let mut budget = p.max_num_batched_tokens.max(1);
        let decoding = running.iter().filter(|s| s.prefill_left == 0).count() as u64;
        budget = budget.saturating_sub(decoding);
        let mut prefilled = 0u64;
        let mut finishing_prefill = Vec::new();
        for (i, s) in running.iter_mut().enumerate() {
            if s.prefill_left == 0 || budget == 0 {
                continue;
            }
            let take = s.prefill_left.min(budget);
            s.prefill_left -= take;
            budget -= take;
            prefilled += take;
            if s.prefill_left == 0 {
                finishing_prefill.push(i);
            }
        }
        let step_us = p.step_overhead_us
            + p.prefill_us_per_token * prefilled as f64
            + p.decode_us_per_seq * decoding as f64;
        deadline += Duration::from_nanos((step_us * 1000.0) as u64);
        let now = Instant::now();
        if now > deadline + Duration::from_millis(50) {
            // Fell far behind (CPU starved): do not burst to catch up.
            deadline = now;
        }
        tokio::time::sleep_until(deadline).await;

        // The step's tokens: one per decoding sequence, the first for each finished prompt.
        let mut emitted = 0u64;
        for (i, s) in running.iter_mut().enumerate() {
            let first = finishing_prefill.binary_search(&i).is_ok();
            let decoded = !first && s.prefill_left == 0 && s.generated > 0;
            if !(first || decoded) {
                continue;
            }
            s.generated += 1;
            s.unsent += 1;
            emitted += 1;
            let done = s.generated >= s.job.max_tokens.max(1);
            if first || done || s.unsent >= p.stream_interval.max(1) {
                let n = std::mem::take(&mut s.unsent);
                if s.job.out.send(Output::Tokens(n)).is_err() {
                    s.generated = u32::MAX; // client gone: abort below
                }
            }
        }
        c.generation_tokens.fetch_add(emitted, Ordering::Relaxed);
        running.retain(|s| {
            let aborted = s.generated == u32::MAX;
            let done = aborted || s.generated >= s.job.max_tokens.max(1);
            if done {
                c.blocks_in_use.fetch_sub(s.blocks, Ordering::Relaxed);
                if aborted {
                    c.aborted.fetch_add(1, Ordering::Relaxed);
                } else {
                    c.finished.fetch_add(1, Ordering::Relaxed);
                    let _ = s.job.out.send(Output::Finished(Usage {
                        prompt_tokens: s.prompt_tokens,
                        cached_tokens: s.cached_tokens,
                        completion_tokens: u64::from(s.generated),
                    }));
                }
            }
            !done
        });
        c.running.store(running.len() as u64, Ordering::Relaxed);
    }
}
