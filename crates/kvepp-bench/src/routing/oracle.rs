//! The clairvoyant reference placements of `bench-routing` (policies `clairvoyant` and
//! `clairvoyant-completion`): what a router that could see inside every engine would do, as
//! yardsticks for the real policies.
//!
//! When a request is sent, it reads each simulated engine's true state — the prompt's prefix its
//! KV pool holds at that instant, the prompt tokens sent there and not yet computed (its queue
//! and unfinished prefills, less what admission found cached), its running sequences and the
//! context they decode over — and sends the request straight to the engine whose time to first
//! token (`clairvoyant`) or whose completion of this request (`clairvoyant-completion`: the
//! TTFT, then its known output length decoded in steps that carry every sequence running there
//! and this one) is lowest, computed with the simulator's own step-cost model (ties: fewer
//! requests).
//! No Envoy, no kvepp: the placement knows every request's cost and each engine's cache exactly
//! and pays no hop, so a policy's figures against it read as "N% of a clairvoyant placement".
//!
//! It is greedy, not an optimum over the whole trace (it does not hold an engine back for a
//! prefix that will come later), which is what a reference placement for an online router is, and what keeps it
//! online.
//!
//! Invariants: reading an engine's state never changes it (the eviction order is untouched), and
//! every request goes to one of the engines given.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvepp_sim::fleet::engine::EngineCore;
use kvepp_sim::fleet::SimParams;

/// What one engine looks like to the clairvoyant placement at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineView {
    /// Prompt tokens sent there and not computed yet.
    pub backlog: u64,
    /// Tokens of context its decoding sequences read each step.
    pub context: u64,
    /// Requests running and waiting there.
    pub requests: u64,
    /// Tokens of this prompt's prefix its cache holds.
    pub cached: u64,
}

/// Time to first token (µs) of a `prompt`-token request on an engine in state `v`, by the
/// simulator's step-cost model: the queued prompt tokens and this one's uncached part are
/// computed in steps of at most `max_num_batched_tokens` (less one per decoding sequence), each
/// step paying its fixed cost and the decoding sequences' cost, plus the prefill's per-token and
/// attention cost.
pub fn ttft_us(p: &SimParams, v: &EngineView, prompt: u64) -> f64 {
    let own = prompt.saturating_sub(v.cached).max(1);
    let work = v.backlog + own;
    let decoding = v.requests as f64;
    let per_step = (p.max_num_batched_tokens as f64 - decoding).max(1.0);
    let steps = (work as f64 / per_step).ceil().max(1.0);
    let step_cost = p.step_overhead_us
        + p.decode_us_per_seq * decoding
        + p.decode_us_per_kctx * v.context as f64 / 1000.0;
    let attention =
        p.prefill_us_per_token_per_kctx * own as f64 * (v.cached as f64 + own as f64 / 2.0)
            / 1000.0;
    steps * step_cost + p.prefill_us_per_token * work as f64 + attention
}

/// Completion time (µs) of a `prompt`-token request of `output` tokens on an engine in state
/// `v`: its [`ttft_us`], then `output − 1` decode steps, each carrying the sequences there and
/// this one over their context and this one's (at mid-decode).
pub fn completion_us(p: &SimParams, v: &EngineView, prompt: u64, output: u64) -> f64 {
    let decoding = v.requests as f64 + 1.0;
    let context = v.context as f64 + prompt as f64 + output as f64 / 2.0;
    let step = p.step_overhead_us
        + p.decode_us_per_seq * decoding
        + p.decode_us_per_kctx * context / 1000.0;
    ttft_us(p, v, prompt) + output.saturating_sub(1) as f64 * step
}

/// What a clairvoyant placement minimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// The request's time to first token.
    FirstToken,
    /// The request's completion.
    Completion,
}

/// The engines the clairvoyant placement chooses among.
#[derive(Debug, Clone)]
pub struct Clairvoyant {
    engines: Vec<(SocketAddr, Arc<EngineCore>)>,
    objective: Objective,
}

impl Clairvoyant {
    pub fn new(
        engines: impl IntoIterator<Item = (SocketAddr, Arc<EngineCore>)>,
        objective: Objective,
    ) -> Self {
        Clairvoyant {
            engines: engines.into_iter().collect(),
            objective,
        }
    }

    fn view(core: &EngineCore, tokens: &[u32]) -> EngineView {
        let c = &core.counters;
        EngineView {
            backlog: c.prefill_backlog.load(Ordering::Relaxed),
            context: c.decode_context.load(Ordering::Relaxed),
            requests: c.running.load(Ordering::Relaxed) + c.waiting.load(Ordering::Relaxed),
            cached: core.cache().cached_prefix_tokens(tokens) as u64,
        }
    }

    /// The engine (index into the list given) with the lowest time to first token (or
    /// completion, of `output` tokens) for `tokens` now; None when there are no engines.
    pub fn choose(&self, tokens: &[u32], output: u64) -> Option<usize> {
        let prompt = tokens.len() as u64;
        self.engines
            .iter()
            .enumerate()
            .map(|(i, (_, core))| {
                let v = Self::view(core, tokens);
                let t = match self.objective {
                    Objective::FirstToken => ttft_us(&core.params, &v, prompt),
                    Objective::Completion => completion_us(&core.params, &v, prompt, output),
                };
                (i, t, v.requests)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.2.cmp(&b.2)))
            .map(|(i, _, _)| i)
    }

    /// The address to send `tokens` (answered with `output` tokens) to (None: no engines).
    pub fn place(&self, tokens: &[u32], output: u64) -> Option<SocketAddr> {
        self.choose(tokens, output).map(|i| self.engines[i].0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_and_the_queue_each_decide_and_the_cost_grows_with_work() {
        let p = SimParams::default();
        let idle = EngineView::default();
        let cached = EngineView {
            cached: 8_000,
            ..idle
        };
        assert!(ttft_us(&p, &cached, 10_000) < ttft_us(&p, &idle, 10_000));
        // A long queue outweighs a cached prefix.
        let busy_cached = EngineView {
            backlog: 60_000,
            requests: 6,
            ..cached
        };
        assert!(ttft_us(&p, &busy_cached, 10_000) > ttft_us(&p, &idle, 10_000));
        // More decoding context or more backlog never makes it faster.
        let decoding = EngineView {
            context: 200_000,
            requests: 20,
            ..idle
        };
        assert!(ttft_us(&p, &decoding, 10_000) > ttft_us(&p, &idle, 10_000));
        // An idle engine's 8k-token prefill: one step, ~6 ms + 8192 × 40 µs + attention.
        let t = ttft_us(&p, &idle, 8_000) / 1000.0;
        assert!((320.0..400.0).contains(&t), "{t} ms");
    }

    #[test]
    fn placement_follows_the_true_cache_and_backlog() {
        let p = SimParams {
            block_size: 4,
            total_kv_blocks: 64,
            ..SimParams::default()
        };
        let cores: Vec<Arc<EngineCore>> = (0..3).map(|_| EngineCore::new(p.clone())).collect();
        let addr = |i: u16| SocketAddr::from(([127, 0, 0, 1], 1000 + i));
        let engines = || {
            cores
                .iter()
                .enumerate()
                .map(|(i, c)| (addr(i as u16), c.clone()))
        };
        let oracle = Clairvoyant::new(engines(), Objective::FirstToken);
        let prompt: Vec<u32> = (0..40).collect();
        // Engine 1 holds the prompt's first 32 tokens.
        {
            let mut cache = cores[1].cache();
            let a = cache.admit(&prompt[..32]).unwrap();
            cache.release(a.holding);
        }
        assert_eq!(oracle.place(&prompt, 16), Some(addr(1)));
        // A large backlog there sends it elsewhere; of the two idle ones, the one with fewer
        // requests.
        cores[1].counters.add_backlog(100_000);
        cores[0].counters.running.store(3, Ordering::Relaxed);
        assert_eq!(oracle.choose(&prompt, 16), Some(2));
        cores[1].counters.take_backlog(u64::MAX);
        assert_eq!(cores[1].counters.prefill_backlog.load(Ordering::Relaxed), 0);
        assert_eq!(
            Clairvoyant::new([], Objective::Completion).place(&prompt, 1),
            None
        );
        // Engine 1 holds the prefix but decodes 40 long streams: each step there is slower, so a
        // 500-token answer is done sooner on an idle engine.
        cores[1].counters.running.store(40, Ordering::Relaxed);
        cores[1]
            .counters
            .decode_context
            .store(400_000, Ordering::Relaxed);
        cores[0].counters.running.store(0, Ordering::Relaxed);
        let completion = Clairvoyant::new(engines(), Objective::Completion);
        let p = &cores[0].params;
        let busy = Clairvoyant::view(&cores[1], &prompt);
        let idle = Clairvoyant::view(&cores[0], &prompt);
        let decode = |v: &EngineView| completion_us(p, v, 40, 500) - ttft_us(p, v, 40);
        assert!(decode(&busy) > decode(&idle));
        assert!(completion_us(p, &busy, 40, 500) > completion_us(p, &idle, 40, 500));
        assert_ne!(completion.choose(&prompt, 500), Some(1));
    }
}
