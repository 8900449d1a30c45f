//! `kvepp-sim gen-trace`: request traces in the Mooncake format (JSON lines of `timestamp` ms,
//! `input_length`, `output_length`, `hash_ids` of 512-token blocks), generated from seeded
//! parameters, so routing can be measured on traces it was never tuned on.
//!
//! - Arrivals: a Poisson process at `rate` whose rate jumps to `burst_factor` × `rate` for bursts
//!   of mean length `burst_seconds`, a share `burst_share` of the time (a two-state modulated
//!   Poisson process).
//! - Lengths: log-normal prompt (the request's own part) and output lengths around their medians,
//!   clamped.
//! - Reuse, by structure: `system-prompts` — a request starts with one of `system_prompts` shared
//!   prompts (Zipf popularity), then its own blocks; `conversations` — a conversation's turns each
//!   carry the previous turn's prompt and its output, then a new question, after a think time; a
//!   share of conversations open with a shared system prompt.
//!
//! Invariants: the same spec gives the same trace; timestamps never decrease; a block id means
//! the same 512 tokens wherever it appears (ids are only reused for shared content); every
//! `input_length` lies within its `hash_ids`' last block.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::PathBuf;

use crate::fleet::SimParams;
use crate::workload::TRACE_BLOCK_TOKENS;

/// How requests reuse each other's prefixes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Structure {
    /// Requests share one of a few long system prompts (Zipf popularity), then differ.
    SystemPrompts,
    /// Multi-turn conversations: each turn extends the previous turn's prompt and answer.
    Conversations,
}

/// Everything a trace is generated from.
#[derive(Debug, Clone, clap::Args)]
pub struct TraceSpec {
    #[arg(long, value_enum, default_value = "conversations")]
    pub structure: Structure,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Requests in the trace.
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Mean arrival rate outside bursts, requests (conversations: turns) per second.
    #[arg(long, default_value_t = 2.0)]
    pub rate: f64,
    /// Arrival rate during a burst, as a multiple of `rate`.
    #[arg(long, default_value_t = 4.0)]
    pub burst_factor: f64,
    /// Share of the time spent in bursts (0-1).
    #[arg(long, default_value_t = 0.15)]
    pub burst_share: f64,
    /// Mean length of a burst, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub burst_seconds: f64,
    /// Median tokens of a request's own part of the prompt (a question, a document).
    #[arg(long, default_value_t = 2048.0)]
    pub input_median: f64,
    /// Log-normal spread (sigma) of the own part's length.
    #[arg(long, default_value_t = 1.0)]
    pub input_sigma: f64,
    #[arg(long, default_value_t = 300.0)]
    pub output_median: f64,
    #[arg(long, default_value_t = 0.8)]
    pub output_sigma: f64,
    /// Shared system prompts and their mean length in tokens.
    #[arg(long, default_value_t = 16)]
    pub system_prompts: usize,
    #[arg(long, default_value_t = 4096)]
    pub system_tokens: usize,
    /// Zipf exponent of the system prompts' popularity.
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// Conversations: share opening with a shared system prompt; mean turns; mean think time.
    #[arg(long, default_value_t = 0.5)]
    pub system_share: f64,
    #[arg(long, default_value_t = 4.0)]
    pub mean_turns: f64,
    #[arg(long, default_value_t = 20.0)]
    pub think_seconds: f64,
    /// Longest prompt, tokens (longer ones are cut).
    #[arg(long, default_value_t = 131_072)]
    pub max_input: usize,
}

impl Default for TraceSpec {
    fn default() -> Self {
        TraceSpec {
            structure: Structure::Conversations,
            seed: 1,
            requests: 1000,
            rate: 2.0,
            burst_factor: 4.0,
            burst_share: 0.15,
            burst_seconds: 10.0,
            input_median: 2048.0,
            input_sigma: 1.0,
            output_median: 300.0,
            output_sigma: 0.8,
            system_prompts: 16,
            system_tokens: 4096,
            zipf: 1.1,
            system_share: 0.5,
            mean_turns: 4.0,
            think_seconds: 20.0,
            max_input: 131_072,
        }
    }
}

/// One request of a trace, as the Mooncake format has it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TraceRow {
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

/// Random draws of the generator.
struct Draw {
    rng: fastrand::Rng,
    next_id: u64,
}

impl Draw {
    fn normal(&mut self) -> f64 {
        // Box-Muller.
        let u = self.rng.f64().max(f64::MIN_POSITIVE);
        let v = self.rng.f64();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }

    fn lognormal(&mut self, median: f64, sigma: f64) -> f64 {
        median * (sigma * self.normal()).exp()
    }

    fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.rng.f64()).max(f64::MIN_POSITIVE).ln()
    }

    /// Fresh block ids for `tokens` tokens (rounded up to whole blocks).
    fn fresh(&mut self, tokens: usize) -> Vec<u64> {
        let n = tokens.div_ceil(TRACE_BLOCK_TOKENS).max(1);
        let ids = (self.next_id..self.next_id + n as u64).collect();
        self.next_id += n as u64;
        ids
    }
}

/// Index into `weights`' cumulative sums (a Zipf draw when they are 1/k^s).
fn pick(rng: &mut fastrand::Rng, cumulative: &[f64]) -> usize {
    let total = cumulative.last().copied().unwrap_or(0.0);
    let x = rng.f64() * total;
    cumulative
        .partition_point(|&c| c <= x)
        .min(cumulative.len().saturating_sub(1))
}

/// Arrival times (seconds) of a two-state modulated Poisson process.
struct Arrivals {
    t: f64,
    burst_until: f64,
    calm_until: f64,
}

impl Arrivals {
    fn next(&mut self, s: &TraceSpec, d: &mut Draw) -> f64 {
        let calm_mean = s.burst_seconds * (1.0 - s.burst_share) / s.burst_share.max(1e-9);
        loop {
            if self.t >= self.calm_until && self.t >= self.burst_until {
                // A new calm spell, then a burst.
                self.calm_until = self.t + d.exponential(calm_mean);
                self.burst_until = self.calm_until + d.exponential(s.burst_seconds);
            }
            let bursting = self.t >= self.calm_until && self.t < self.burst_until;
            let rate = if bursting {
                s.rate * s.burst_factor
            } else {
                s.rate
            };
            let gap = d.exponential(1.0 / rate.max(1e-9));
            let end = if bursting {
                self.burst_until
            } else {
                self.calm_until
            };
            if s.burst_share <= 0.0 || self.t + gap < end {
                self.t += gap;
                return self.t;
            }
            // The state changes before the next arrival: memoryless, so start over from there.
            self.t = end;
        }
    }
}

/// The trace `s` describes.
pub fn generate(s: &TraceSpec) -> Vec<TraceRow> {
    let mut d = Draw {
        rng: fastrand::Rng::with_seed(s.seed),
        next_id: 0,
    };
    let systems: Vec<Vec<u64>> = (0..s.system_prompts.max(1))
        .map(|_| {
            let tokens = d.lognormal(s.system_tokens as f64, 0.3) as usize;
            d.fresh(tokens)
        })
        .collect();
    let mut acc = 0.0;
    let cumulative: Vec<f64> = (1..=systems.len())
        .map(|k| {
            acc += 1.0 / (k as f64).powf(s.zipf);
            acc
        })
        .collect();
    let mut arrivals = Arrivals {
        t: 0.0,
        burst_until: 0.0,
        calm_until: 0.0,
    };
    let mut rows = match s.structure {
        Structure::SystemPrompts => (0..s.requests)
            .map(|_| {
                let at = arrivals.next(s, &mut d);
                let mut ids = systems[pick(&mut d.rng, &cumulative)].clone();
                let own = d.lognormal(s.input_median, s.input_sigma) as usize;
                ids.extend(d.fresh(own));
                row(s, &mut d, at, ids)
            })
            .collect(),
        Structure::Conversations => {
            // Conversations start at `rate` / `mean_turns`: their turns together come at `rate`.
            let starts = TraceSpec {
                rate: s.rate / s.mean_turns.max(1.0),
                ..s.clone()
            };
            conversations(&starts, &mut d, &systems, &cumulative, &mut arrivals)
        }
    };
    rows.sort_by_key(|r| r.timestamp);
    rows
}

/// A request arriving at `at` seconds with prompt blocks `ids`.
fn row(s: &TraceSpec, d: &mut Draw, at: f64, mut ids: Vec<u64>) -> TraceRow {
    let max_blocks = s.max_input.div_ceil(TRACE_BLOCK_TOKENS).max(1);
    ids.truncate(max_blocks);
    // The last block may be partly filled.
    let full = (ids.len() - 1) * TRACE_BLOCK_TOKENS;
    let input_length = (full + 1 + d.rng.usize(..TRACE_BLOCK_TOKENS)).min(s.max_input);
    let output = d
        .lognormal(s.output_median, s.output_sigma)
        .clamp(1.0, 16_384.0) as u32;
    TraceRow {
        timestamp: (at * 1000.0) as u64,
        input_length,
        output_length: output,
        hash_ids: ids,
    }
}

/// Conversations start at the arrival process's times; each next turn follows the previous one
/// after a think time, carrying its prompt, its answer and a new question.
fn conversations(
    s: &TraceSpec,
    d: &mut Draw,
    systems: &[Vec<u64>],
    cumulative: &[f64],
    arrivals: &mut Arrivals,
) -> Vec<TraceRow> {
    // Turns due, earliest first: (time in µs, conversation's prompt so far, turns left).
    let mut due: BinaryHeap<Reverse<(u64, Vec<u64>, u32)>> = BinaryHeap::new();
    let mut out = Vec::with_capacity(s.requests);
    // Turns per conversation ~ 1 + geometric: the mean is `mean_turns`.
    let p_more = 1.0 - 1.0 / s.mean_turns.max(1.0);
    let mut next_start = arrivals.next(s, d);
    while out.len() < s.requests {
        let start_us = (next_start * 1e6) as u64;
        let next_turn = due.peek().map(|Reverse((t, _, _))| *t);
        if next_turn.is_none_or(|t| start_us <= t) {
            let mut turns = 1;
            while d.rng.f64() < p_more && turns < 64 {
                turns += 1;
            }
            let prefix = if d.rng.f64() < s.system_share {
                systems[pick(&mut d.rng, cumulative)].clone()
            } else {
                Vec::new()
            };
            due.push(Reverse((start_us, prefix, turns)));
            next_start = arrivals.next(s, d);
            continue;
        }
        let Some(Reverse((t, mut ids, left))) = due.pop() else {
            break;
        };
        let question = d.lognormal(s.input_median, s.input_sigma) as usize;
        ids.extend(d.fresh(question));
        let r = row(s, d, t as f64 / 1e6, ids.clone());
        if left > 1 {
            // The next turn carries this prompt and the answer to it.
            ids.extend(d.fresh(r.output_length as usize));
            let think = d.exponential(s.think_seconds);
            let at = t + ((r.output_length as f64 * 0.02 + think) * 1e6) as u64;
            due.push(Reverse((at, ids, left - 1)));
        }
        out.push(r);
    }
    out
}

/// The trace as JSON lines.
pub fn to_jsonl(rows: &[TraceRow]) -> String {
    rows.iter()
        .filter_map(|r| serde_json::to_string(r).ok())
        .map(|l| l + "\n")
        .collect()
}

/// The share of prompt blocks that appeared in an earlier request (the reuse a cache shared by
/// everyone, of unbounded size, could serve).
pub fn reuse_share(rows: &[TraceRow]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut reused, mut total) = (0usize, 0usize);
    for r in rows {
        for id in &r.hash_ids {
            total += 1;
            reused += usize::from(!seen.insert(*id));
        }
    }
    reused as f64 / total.max(1) as f64
}

/// Requests per second `engines` simulated engines with parameters `p` serve at most on the mix
/// of `rows` (outputs capped at `max_output`, as the routing benchmark caps them): every request
/// prefills only the blocks no earlier request had (a cache that serves all reuse) and decodes in
/// full batches (the step's fixed cost shared by `max_num_seqs` sequences). An optimistic bound:
/// loads are stated as a share of it.
pub fn capacity_rps(rows: &[TraceRow], p: &SimParams, engines: usize, max_output: u32) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let mut busy_us = 0.0;
    for r in rows {
        let new_blocks = r.hash_ids.iter().filter(|id| seen.insert(**id)).count();
        let new_tokens = (new_blocks * TRACE_BLOCK_TOKENS).min(r.input_length) as f64;
        let ctx_k = r.input_length as f64 / 1000.0;
        let prefill =
            new_tokens * (p.prefill_us_per_token + p.prefill_us_per_token_per_kctx * ctx_k / 2.0);
        let per_token = p.step_overhead_us / p.max_num_seqs.max(1) as f64
            + p.decode_us_per_seq
            + p.decode_us_per_kctx * ctx_k;
        busy_us += prefill + f64::from(r.output_length.min(max_output)) * per_token;
    }
    engines as f64 * 1e6 * rows.len() as f64 / busy_us.max(1.0)
}

/// Stretches or squeezes `rows`' timestamps so that they arrive at `rate` requests per second on
/// average (the shape of the arrivals, bursts included, kept).
pub fn retime(rows: &mut [TraceRow], rate: f64) {
    let span = rows.last().map_or(0, |r| r.timestamp) as f64 / 1000.0;
    if span <= 0.0 || rate <= 0.0 {
        return;
    }
    let factor = (rows.len() as f64 / rate) / span;
    for r in rows {
        r.timestamp = (r.timestamp as f64 * factor) as u64;
    }
}

#[derive(Debug, clap::Args)]
pub struct GenTraceArgs {
    #[command(flatten)]
    pub spec: TraceSpec,
    /// Retime the trace to this share of the fleet's capacity ([`capacity_rps`] of `--engines`
    /// default simulated engines); unset: the arrival rate of the spec.
    #[arg(long)]
    pub target_load: Option<f64>,
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    /// The routing benchmark's output cap (`bench-routing --max-output`).
    #[arg(long, default_value_t = 512)]
    pub max_output: u32,
    /// Where to write the trace (JSON lines).
    #[arg(long)]
    pub out: PathBuf,
}

/// `kvepp-sim gen-trace`.
pub fn run(args: &GenTraceArgs) -> std::io::Result<()> {
    let mut rows = generate(&args.spec);
    let capacity = capacity_rps(&rows, &SimParams::default(), args.engines, args.max_output);
    if let Some(load) = args.target_load {
        retime(&mut rows, load * capacity);
    }
    std::fs::write(&args.out, to_jsonl(&rows))?;
    let span = rows.last().map_or(0, |r| r.timestamp) as f64 / 1000.0;
    let tokens: usize = rows.iter().map(|r| r.input_length).sum();
    println!(
        "{} requests over {span:.0} s ({:.2} req/s, {:.0}% of {capacity:.1} req/s, the capacity of {} engines), mean prompt {:.0} tokens, {:.1}% of prompt blocks seen before → {}",
        rows.len(),
        rows.len() as f64 / span.max(1e-9),
        100.0 * rows.len() as f64 / span.max(1e-9) / capacity,
        args.engines,
        tokens as f64 / rows.len().max(1) as f64,
        100.0 * reuse_share(&rows),
        args.out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(structure: Structure, seed: u64) -> TraceSpec {
        TraceSpec {
            structure,
            seed,
            requests: 600,
            ..TraceSpec::default()
        }
    }

    #[test]
    fn a_seed_gives_one_trace_and_another_seed_another() {
        for st in [Structure::SystemPrompts, Structure::Conversations] {
            let a = generate(&spec(st, 3));
            assert_eq!(a, generate(&spec(st, 3)));
            assert_ne!(a, generate(&spec(st, 4)));
            assert_eq!(a.len(), 600);
            assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            for r in &a {
                let blocks = r.hash_ids.len();
                assert!(blocks >= 1 && r.input_length <= blocks * TRACE_BLOCK_TOKENS);
                assert!(r.input_length > (blocks - 1) * TRACE_BLOCK_TOKENS);
                assert!(r.output_length >= 1);
            }
            // It reads back as the routing benchmark reads a Mooncake trace.
            let back: Vec<TraceRow> = to_jsonl(&a)
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_eq!(back, a);
        }
    }

    #[test]
    fn each_structure_reuses_prefixes_its_own_way() {
        let sp = generate(&spec(Structure::SystemPrompts, 5));
        // Every request starts with one of the shared prompts: its first block was seen before
        // for all but the first request of each prompt.
        let firsts: std::collections::HashSet<u64> = sp.iter().map(|r| r.hash_ids[0]).collect();
        assert!(firsts.len() <= 16, "{} distinct openings", firsts.len());
        let conv = generate(&spec(Structure::Conversations, 5));
        // A later turn's prompt starts with an earlier request's whole prompt.
        let prompts: std::collections::HashSet<&[u64]> =
            conv.iter().map(|r| &r.hash_ids[..]).collect();
        let follow_ups = conv
            .iter()
            .filter(|r| (1..r.hash_ids.len()).any(|k| prompts.contains(&r.hash_ids[..k])))
            .count();
        assert!(
            follow_ups > 300,
            "{follow_ups} of 600 continue an earlier turn"
        );
        for rows in [&sp, &conv] {
            let share = reuse_share(rows);
            assert!((0.25..0.95).contains(&share), "reuse {share}");
        }
    }

    #[test]
    fn retiming_sets_the_mean_rate_and_capacity_grows_with_reuse() {
        let mut rows = generate(&spec(Structure::SystemPrompts, 2));
        retime(&mut rows, 10.0);
        let span = rows.last().unwrap().timestamp as f64 / 1000.0;
        let rate = rows.len() as f64 / span;
        assert!((9.9..10.1).contains(&rate), "{rate}");
        let p = SimParams::default();
        let c8 = capacity_rps(&rows, &p, 8, 512);
        assert!((capacity_rps(&rows, &p, 4, 512) * 2.0 - c8).abs() < 1e-6 * c8);
        // The same requests without reuse (every block new) cost more prefill.
        let mut fresh = rows.clone();
        let mut next = 1u64 << 40;
        for r in &mut fresh {
            for id in &mut r.hash_ids {
                *id = next;
                next += 1;
            }
        }
        assert!(capacity_rps(&fresh, &p, 8, 512) < c8);
    }

    #[test]
    fn bursts_raise_the_arrival_rate_for_a_while() {
        let s = TraceSpec {
            structure: Structure::SystemPrompts,
            requests: 4000,
            rate: 2.0,
            burst_factor: 8.0,
            burst_share: 0.2,
            burst_seconds: 20.0,
            ..TraceSpec::default()
        };
        let rows = generate(&s);
        // Requests per 10 s window: bursts make the busiest window far above the mean.
        let mut counts = std::collections::BTreeMap::new();
        for r in &rows {
            *counts.entry(r.timestamp / 10_000).or_insert(0usize) += 1;
        }
        let max = counts.values().copied().max().unwrap_or(0) as f64;
        let mean = rows.len() as f64 / counts.len() as f64;
        assert!(max > 3.0 * mean, "busiest window {max}, mean {mean}");
        // Without bursts, the mean rate is the rate asked for.
        let calm = generate(&TraceSpec {
            burst_share: 0.0,
            ..s.clone()
        });
        let span = calm.last().unwrap().timestamp as f64 / 1000.0;
        let rate = calm.len() as f64 / span;
        assert!((1.8..2.2).contains(&rate), "{rate} req/s");
    }
}
