//! The workloads the routing benchmark replays: the Mooncake conversation trace (hash ids →
//! deterministic token blocks), a synthetic shared-prefix workload (groups of requests sharing
//! a long system prompt) and multi-turn conversations (each turn carries the previous prompt and
//! the tokens the engine generated for it, token for token, then a new question), optionally with
//! a share of the conversations sent straight to the engines by a second client. Request bodies
//! are built before the replay starts.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::fleet::cache::generated_tokens;
pub use crate::fleet::cache::VOCAB;
use kvepp_core::hash::{local_block_hashes, sequence_hashes};

/// Tokens each Mooncake hash id stands for.
pub const TRACE_BLOCK_TOKENS: usize = 512;

/// One request to replay.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Arrival time from the start of the replay (before the speed factor), or with `after`,
    /// the think time after that request's response ended.
    pub at: Duration,
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    /// The earlier request (the previous turn) whose response this one waits for.
    pub after: Option<usize>,
    /// Sent by a second client straight to engine `n` (modulo the engines that answer clients),
    /// bypassing Envoy and kvepp; not counted in the policy's results.
    pub direct: Option<usize>,
    /// The model it names instead of the fleet's (a LoRA adapter).
    pub model: Option<std::sync::Arc<str>>,
    /// Its session id (sent as `x-session-id`).
    pub session: Option<std::sync::Arc<str>>,
}

impl Request {
    /// The `/v1/completions` body: token-id prompt, streamed, with usage in the last chunk.
    pub fn body(&self, model: &str) -> Bytes {
        let model = self.model.as_deref().unwrap_or(model);
        let v = serde_json::json!({
            "model": model, "prompt": self.tokens, "max_tokens": self.max_tokens,
            "stream": true, "stream_options": {"include_usage": true},
        });
        Bytes::from(v.to_string())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    #[error("cannot read trace {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("trace {path}, line {line}: {source}")]
    Parse {
        path: String,
        line: usize,
        source: serde_json::Error,
    },
}

#[derive(Debug, Deserialize)]
struct TraceRow {
    timestamp: u64,
    input_length: usize,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// The 512 tokens of one trace hash id (equal ids give equal tokens).
pub fn trace_block(id: u64) -> impl Iterator<Item = u32> {
    (0..TRACE_BLOCK_TOKENS as u64)
        .map(move |i| (xxh3_64_with_seed(&i.to_le_bytes(), id) % VOCAB) as u32)
}

/// The first `limit` requests of a Mooncake trace (JSON lines: `timestamp` ms, `input_length`,
/// `output_length`, `hash_ids`; gzipped when named `.gz`), outputs capped at `max_output`.
pub fn mooncake(path: &Path, limit: usize, max_output: u32) -> Result<Vec<Request>, WorkloadError> {
    let p = path.display().to_string();
    let text =
        kvepp_test_support::trace::read_text(path).map_err(|source| WorkloadError::Read {
            path: p.clone(),
            source,
        })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().filter(|l| !l.trim().is_empty()).enumerate() {
        if out.len() >= limit {
            break;
        }
        let row: TraceRow = serde_json::from_str(line).map_err(|source| WorkloadError::Parse {
            path: p.clone(),
            line: i + 1,
            source,
        })?;
        let mut tokens: Vec<u32> = Vec::with_capacity(row.input_length);
        for &id in &row.hash_ids {
            tokens.extend(trace_block(id));
        }
        // Prompts longer than their hash ids pad with request-specific tokens.
        let pad = row.input_length.saturating_sub(tokens.len());
        tokens.extend(
            (0..pad as u64)
                .map(|k| (xxh3_64_with_seed(&k.to_le_bytes(), !(i as u64)) % VOCAB) as u32),
        );
        tokens.truncate(row.input_length);
        out.push(Request {
            at: Duration::from_millis(row.timestamp),
            tokens,
            max_tokens: row.output_length.clamp(1, max_output.max(1)),
            ..Request::default()
        });
    }
    Ok(out)
}

/// Shape of the synthetic shared-prefix workload.
#[derive(Debug, Clone)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub groups: usize,
    pub system_tokens: usize,
    /// Each request's own question after the system prompt.
    pub user_tokens: usize,
    pub output_tokens: (u32, u32),
    /// Mean arrival rate (Poisson), requests per second.
    pub rate: f64,
    pub duration: Duration,
    pub seed: u64,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        SharedPrefix {
            groups: 48,
            system_tokens: 4096,
            user_tokens: 512,
            output_tokens: (32, 128),
            rate: 24.0,
            duration: Duration::from_secs(20),
            seed: 42,
        }
    }
}

/// Requests of the shared-prefix workload: Poisson arrivals, a uniformly random group each.
pub fn shared_prefix(s: &SharedPrefix) -> Vec<Request> {
    let mut rng = fastrand::Rng::with_seed(s.seed);
    let tok = |rng: &mut fastrand::Rng| rng.u32(..VOCAB as u32);
    let systems: Vec<Vec<u32>> = (0..s.groups)
        .map(|_| (0..s.system_tokens).map(|_| tok(&mut rng)).collect())
        .collect();
    let mut out = Vec::new();
    let mut t = 0.0f64;
    loop {
        // Exponential inter-arrival times.
        t += -(1.0 - rng.f64()).ln() / s.rate.max(1e-9);
        if t >= s.duration.as_secs_f64() || s.groups == 0 {
            break;
        }
        let mut tokens = systems[rng.usize(..s.groups)].clone();
        tokens.extend((0..s.user_tokens).map(|_| tok(&mut rng)));
        out.push(Request {
            at: Duration::from_secs_f64(t),
            tokens,
            max_tokens: rng.u32(s.output_tokens.0..=s.output_tokens.1.max(s.output_tokens.0)),
            ..Request::default()
        });
    }
    out
}

/// Shape of the burst workload: every `spacing`, a new prefix no engine has seen arrives with
/// `size` requests within `spread` of one another (a fan-out of one document to many questions,
/// an agent's parallel calls), faster than any engine's KV events can confirm it.
#[derive(Debug, Clone)]
pub struct Burst {
    pub bursts: usize,
    pub size: usize,
    pub spacing: Duration,
    pub spread: Duration,
    pub prefix_tokens: usize,
    pub user_tokens: usize,
    pub output_tokens: (u32, u32),
    pub seed: u64,
}

impl Default for Burst {
    fn default() -> Self {
        Burst {
            bursts: 40,
            size: 8,
            spacing: Duration::from_millis(500),
            spread: Duration::from_millis(10),
            prefix_tokens: 4096,
            user_tokens: 128,
            output_tokens: (32, 128),
            seed: 11,
        }
    }
}

/// Requests of the burst workload, in order of arrival.
pub fn burst(b: &Burst) -> Vec<Request> {
    let mut rng = fastrand::Rng::with_seed(b.seed);
    let tok = |rng: &mut fastrand::Rng| rng.u32(..VOCAB as u32);
    let mut out = Vec::with_capacity(b.bursts * b.size);
    for k in 0..b.bursts {
        let prefix: Vec<u32> = (0..b.prefix_tokens).map(|_| tok(&mut rng)).collect();
        for _ in 0..b.size {
            let mut tokens = prefix.clone();
            tokens.extend((0..b.user_tokens).map(|_| tok(&mut rng)));
            let offset = b.spread.mul_f64(rng.f64());
            out.push(Request {
                at: b.spacing * k as u32 + offset,
                tokens,
                max_tokens: rng.u32(b.output_tokens.0..=b.output_tokens.1.max(b.output_tokens.0)),
                ..Request::default()
            });
        }
    }
    out.sort_by_key(|r| r.at);
    out
}

/// Shape of the multi-turn conversation workload.
#[derive(Debug, Clone)]
pub struct MultiTurn {
    /// New conversations per second (Poisson) over `duration`.
    pub rate: f64,
    pub duration: Duration,
    /// Turns per conversation, uniformly in this range.
    pub turns: (usize, usize),
    /// Distinct system prompts (each conversation starts with one) and their length.
    pub system_prompts: usize,
    pub system_tokens: usize,
    /// Tokens of each new user message.
    pub user_tokens: (usize, usize),
    pub output_tokens: (u32, u32),
    /// Mean think time between a response's end and the next turn (exponential).
    pub think: Duration,
    /// Share of the conversations a second client sends straight to an engine of its choice
    /// (sticky per conversation), unseen by kvepp.
    pub direct_share: f64,
    pub seed: u64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        MultiTurn {
            rate: 4.0,
            duration: Duration::from_secs(20),
            turns: (3, 6),
            system_prompts: 8,
            system_tokens: 1024,
            user_tokens: (128, 768),
            output_tokens: (64, 256),
            think: Duration::from_secs(2),
            direct_share: 0.0,
            seed: 7,
        }
    }
}

/// Requests of the multi-turn workload: each turn's prompt is the previous turn's prompt, the
/// tokens the engine generates for it ([`generated_tokens`]) and a new user message; it is sent a
/// think time after the previous response ends.
pub fn multi_turn(m: &MultiTurn) -> Vec<Request> {
    let mut rng = fastrand::Rng::with_seed(m.seed);
    let tok = |rng: &mut fastrand::Rng| rng.u32(..VOCAB as u32);
    let systems: Vec<Vec<u32>> = (0..m.system_prompts.max(1))
        .map(|_| (0..m.system_tokens).map(|_| tok(&mut rng)).collect())
        .collect();
    let range = |rng: &mut fastrand::Rng, (a, b): (usize, usize)| rng.usize(a..=b.max(a));
    let mut out: Vec<Request> = Vec::new();
    let mut t = 0.0f64;
    let mut conversation = 0usize;
    loop {
        t += -(1.0 - rng.f64()).ln() / m.rate.max(1e-9);
        if t >= m.duration.as_secs_f64() {
            break;
        }
        let direct = (rng.f64() < m.direct_share).then_some(conversation);
        conversation += 1;
        let mut prompt = systems[rng.usize(..systems.len())].clone();
        let mut previous: Option<(usize, u32)> = None;
        for _ in 0..range(&mut rng, m.turns).max(1) {
            if let Some((i, n)) = previous {
                let answer = generated_tokens(&out[i].tokens, n);
                prompt.extend(answer);
            }
            let user = range(&mut rng, m.user_tokens);
            prompt.extend((0..user).map(|_| tok(&mut rng)));
            let max_tokens = rng.u32(m.output_tokens.0..=m.output_tokens.1.max(m.output_tokens.0));
            let at = match previous {
                None => Duration::from_secs_f64(t),
                Some(_) => Duration::from_secs_f64(-(1.0 - rng.f64()).ln() * m.think.as_secs_f64()),
            };
            out.push(Request {
                at,
                tokens: prompt.clone(),
                max_tokens,
                after: previous.map(|(i, _)| i),
                direct,
                ..Request::default()
            });
            previous = Some((out.len() - 1, max_tokens));
        }
    }
    out
}

/// The workload's prefix-cache hit ceiling over the requests kvepp routes: the share of prompt
/// tokens in full blocks whose prefix appeared in an earlier request's prompt or output (an
/// infinite cache shared by everyone, requests in the order given; the last prompt token is
/// always computed, the last output token never is).
pub fn hit_ceiling(requests: &[Request], block_size: usize) -> f64 {
    hit_ceiling_with_capacity(requests, block_size, usize::MAX)
}

/// [`hit_ceiling`] for one shared prefix cache of `capacity` blocks that evicts the least
/// recently used block (a request's blocks are used leaf first, so its tail goes before its
/// head, as vLLM frees them): what the fleet's KV memory keeps of the workload if every request
/// could use all of it. A reference for routing, not a bound: it ignores the blocks running
/// requests pin, and caches split by engine can keep other sets than one LRU does.
pub fn hit_ceiling_with_capacity(requests: &[Request], block_size: usize, capacity: usize) -> f64 {
    let mut cache = Lru::new(capacity);
    let (mut hit, mut total) = (0u64, 0u64);
    for r in requests {
        let mut all = r.tokens.clone();
        all.extend(generated_tokens(&r.tokens, r.max_tokens.saturating_sub(1)));
        let produced = sequence_hashes(&local_block_hashes(&all, block_size, None));
        if r.direct.is_none() {
            let hashes = sequence_hashes(&local_block_hashes(&r.tokens, block_size, None));
            let reusable = r.tokens.len().saturating_sub(1) / block_size.max(1);
            let run = hashes[..reusable.min(hashes.len())]
                .iter()
                .take_while(|h| cache.contains(h.0))
                .count();
            hit += (run * block_size) as u64;
            total += r.tokens.len() as u64;
        }
        for h in produced.iter().rev() {
            cache.touch(h.0);
        }
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}

/// Block hashes in least-recently-used order, at most `capacity` of them: the last use of each
/// block in a map, every use in a log read from its oldest end when something must go (a use
/// superseded by a later one is skipped there).
struct Lru {
    capacity: usize,
    clock: u64,
    last_use: HashMap<u64, u64>,
    log: VecDeque<(u64, u64)>,
}

impl Lru {
    fn new(capacity: usize) -> Self {
        Lru {
            capacity,
            clock: 0,
            last_use: HashMap::new(),
            log: VecDeque::new(),
        }
    }

    fn contains(&self, h: u64) -> bool {
        self.last_use.contains_key(&h)
    }

    fn touch(&mut self, h: u64) {
        self.clock += 1;
        self.last_use.insert(h, self.clock);
        if self.capacity == usize::MAX {
            // Nothing is ever evicted: no log to keep.
            return;
        }
        self.log.push_back((self.clock, h));
        while self.last_use.len() > self.capacity {
            let Some((at, old)) = self.log.pop_front() else {
                break;
            };
            if self.last_use.get(&old) == Some(&at) {
                self.last_use.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn equal_hash_ids_give_equal_tokens_and_the_ceiling_counts_them() {
        let dir = kvepp_test_support::TempDir::new("trace");
        let path = dir.path().join("t.jsonl");
        std::fs::write(
            &path,
            "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 5, \"hash_ids\": [7, 8]}\n\
             {\"timestamp\": 10, \"input_length\": 1000, \"output_length\": 900, \"hash_ids\": [7, 9]}\n",
        )
        .unwrap();
        let r = mooncake(&path, 10, 100).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].at, Duration::from_millis(10));
        assert_eq!((r[0].tokens.len(), r[1].tokens.len()), (1024, 1000));
        assert_eq!(r[0].tokens[..512], r[1].tokens[..512]);
        assert_ne!(r[0].tokens[512..600], r[1].tokens[512..600]);
        assert_eq!(r[1].max_tokens, 100);
        // The second request reuses the 512 tokens of id 7: 512 of 2024 prompt tokens.
        assert!((hit_ceiling(&r, 16) - 512.0 / 2024.0).abs() < 1e-9);
        // Room for all 70 blocks of the first request's prompt and output, or for just the 32
        // of the shared 512 tokens (its head, used last, stays longest): the same; with 31, one
        // block less; with none, nothing.
        assert!((hit_ceiling_with_capacity(&r, 16, 128) - 512.0 / 2024.0).abs() < 1e-9);
        assert!((hit_ceiling_with_capacity(&r, 16, 32) - 512.0 / 2024.0).abs() < 1e-9);
        assert_eq!(hit_ceiling_with_capacity(&r, 16, 31), 31.0 * 16.0 / 2024.0);
        assert_eq!(hit_ceiling_with_capacity(&r, 16, 0), 0.0);
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, "{\"timestamp\": 0}\n").unwrap();
        let e = mooncake(&bad, 10, 100).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let s = SharedPrefix {
            groups: 3,
            system_tokens: 64,
            user_tokens: 16,
            rate: 100.0,
            duration: Duration::from_secs(2),
            ..SharedPrefix::default()
        };
        let r = shared_prefix(&s);
        assert!(r.len() > 100, "{}", r.len());
        assert!(r.windows(2).all(|w| w[0].at <= w[1].at));
        let heads: HashSet<Vec<u32>> = r.iter().map(|q| q.tokens[..64].to_vec()).collect();
        assert_eq!(heads.len(), 3);
        // Everything after the first request of each group is cached but the user part.
        let c = hit_ceiling(&r, 16);
        assert!(c > 0.7 && c < 0.8, "{c}");
        assert_eq!(shared_prefix(&s)[5].tokens, r[5].tokens, "deterministic");
    }

    #[test]
    fn a_turn_carries_the_previous_prompt_and_answer() {
        let m = MultiTurn {
            rate: 5.0,
            duration: Duration::from_secs(4),
            system_tokens: 64,
            user_tokens: (16, 32),
            output_tokens: (8, 24),
            direct_share: 0.5,
            ..MultiTurn::default()
        };
        let r = multi_turn(&m);
        let follow: Vec<&Request> = r.iter().filter(|q| q.after.is_some()).collect();
        assert!(
            follow.len() >= 2 * (r.len() - follow.len()),
            "3-6 turns each"
        );
        for q in follow {
            let prev = &r[q.after.unwrap()];
            let n = prev.tokens.len();
            assert_eq!(q.tokens[..n], prev.tokens[..], "the previous prompt");
            let answer = generated_tokens(&prev.tokens, prev.max_tokens);
            assert_eq!(q.tokens[n..n + answer.len()], answer[..], "its answer");
            assert!(q.tokens.len() >= n + answer.len() + 16, "a new question");
            assert_eq!(q.direct, prev.direct, "a conversation keeps its client");
        }
        assert!(r.iter().any(|q| q.direct.is_some()) && r.iter().any(|q| q.direct.is_none()));
        // The answers are reusable: the ceiling counts them.
        let routed: Vec<Request> = r
            .into_iter()
            .map(|q| Request { direct: None, ..q })
            .collect();
        let with = hit_ceiling(&routed, 16);
        let prompts_only: Vec<Request> = routed
            .iter()
            .map(|q| Request {
                max_tokens: 0,
                ..q.clone()
            })
            .collect();
        assert!(with > hit_ceiling(&prompts_only, 16) + 0.05, "{with}");
    }
}
