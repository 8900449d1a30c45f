//! Active-request load per (worker, data-parallel rank), with the slot-tracker semantics of Dynamo:
//! what the cost model reads and what a pick books.
//!
//! Invariants:
//! - `active_decode_blocks` of a rank is the number of distinct prompt sequence hashes of its active
//!   requests: shared prefixes count once (reference-counted);
//! - `active_prefill_tokens` is the sum of `new_isl_tokens` of its active requests whose prefill has
//!   not completed;
//! - every request is counted on exactly one rank until freed, its rank is unregistered, or it is
//!   older than the stale-request limit (300 s by default).
//!
//! The clock is passed in, so nothing here sleeps or reads time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::hash::SequenceHash;

/// Requests older than this are dropped by [`SlotTracker::expire`] (Dynamo's default).
pub const STALE_REQUEST_AFTER: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    pub worker: u64,
    pub dp_rank: u32,
}

/// The current load of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RankLoad {
    pub active_requests: u32,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

/// What a rank's load would be with one more request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PotentialLoad {
    pub rank: WorkerRank,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u32,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SlotError {
    #[error("worker {} rank {} is not registered", .0.worker, .0.dp_rank)]
    UnknownRank(WorkerRank),
    #[error("request {0:?} is already active")]
    DuplicateRequest(String),
    #[error("request {0:?} is not active")]
    UnknownRequest(String),
}

#[derive(Debug, Default)]
struct RankState {
    active_requests: u32,
    prefill_tokens: u64,
    blocks: HashMap<SequenceHash, u32>,
    /// Output blocks of active requests, each weighted by its decay fraction.
    output_blocks: f64,
}

impl RankState {
    /// Prompt blocks (distinct) plus weighted output blocks, rounded.
    fn decode_blocks(&self) -> u64 {
        self.blocks.len() as u64 + self.output_blocks.max(0.0).round() as u64
    }
}

#[derive(Debug)]
struct Active {
    rank: WorkerRank,
    hashes: Vec<SequenceHash>,
    /// Tokens still in prefill (0 once prefill completed).
    prefill_tokens: u64,
    /// Sum of this request's output-block weights.
    output_blocks: f64,
    added: Instant,
}

#[derive(Debug)]
pub struct SlotTracker {
    ranks: HashMap<WorkerRank, RankState>,
    requests: HashMap<String, Active>,
    stale_after: Duration,
}

impl Default for SlotTracker {
    fn default() -> Self {
        SlotTracker::new(STALE_REQUEST_AFTER)
    }
}

impl SlotTracker {
    pub fn new(stale_after: Duration) -> Self {
        SlotTracker {
            ranks: HashMap::new(),
            requests: HashMap::new(),
            stale_after,
        }
    }

    /// Makes a rank schedulable (idempotent).
    pub fn register(&mut self, rank: WorkerRank) {
        self.ranks.entry(rank).or_default();
    }

    /// Removes every rank of `worker` and its active requests.
    pub fn unregister_worker(&mut self, worker: u64) {
        self.ranks.retain(|r, _| r.worker != worker);
        self.requests.retain(|_, a| a.rank.worker != worker);
    }

    pub fn ranks(&self) -> impl Iterator<Item = WorkerRank> + '_ {
        self.ranks.keys().copied()
    }

    /// Every registered rank with its current load (unordered).
    pub fn loads(&self) -> impl Iterator<Item = (WorkerRank, RankLoad)> + '_ {
        self.ranks.iter().map(|(rank, s)| {
            (
                *rank,
                RankLoad {
                    active_requests: s.active_requests,
                    active_prefill_tokens: s.prefill_tokens,
                    active_decode_blocks: s.decode_blocks(),
                },
            )
        })
    }

    /// Whether `request_id` is active.
    pub fn is_active(&self, request_id: &str) -> bool {
        self.requests.contains_key(request_id)
    }

    /// Number of active requests.
    pub fn active_count(&self) -> usize {
        self.requests.len()
    }

    /// Books a request's prompt blocks and prefill tokens on `rank`.
    pub fn add(
        &mut self,
        request_id: &str,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
        now: Instant,
    ) -> Result<(), SlotError> {
        if self.requests.contains_key(request_id) {
            return Err(SlotError::DuplicateRequest(request_id.to_owned()));
        }
        let state = self
            .ranks
            .get_mut(&rank)
            .ok_or(SlotError::UnknownRank(rank))?;
        state.active_requests += 1;
        state.prefill_tokens += new_isl_tokens;
        for h in hashes {
            *state.blocks.entry(*h).or_insert(0) += 1;
        }
        let active = Active {
            rank,
            hashes: hashes.to_vec(),
            prefill_tokens: new_isl_tokens,
            output_blocks: 0.0,
            added: now,
        };
        self.requests.insert(request_id.to_owned(), active);
        Ok(())
    }

    /// The request's first output token exists: its prefill tokens no longer load the rank.
    /// Repeating it is a no-op.
    pub fn prefill_complete(&mut self, request_id: &str) -> Result<(), SlotError> {
        let active = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.to_owned()))?;
        let tokens = std::mem::take(&mut active.prefill_tokens);
        if let Some(state) = self.ranks.get_mut(&active.rank) {
            state.prefill_tokens -= tokens;
        }
        Ok(())
    }

    /// The request produced another block of output: it adds `decay_fraction` (default 1, clamped
    /// to [0, 1]) of a block to its rank's decode load until the request ends.
    pub fn add_output_block(
        &mut self,
        request_id: &str,
        decay_fraction: Option<f64>,
    ) -> Result<(), SlotError> {
        let active = self
            .requests
            .get_mut(request_id)
            .ok_or_else(|| SlotError::UnknownRequest(request_id.to_owned()))?;
        let w = decay_fraction.unwrap_or(1.0);
        let w = if w.is_finite() {
            w.clamp(0.0, 1.0)
        } else {
            1.0
        };
        active.output_blocks += w;
        if let Some(state) = self.ranks.get_mut(&active.rank) {
            state.output_blocks += w;
        }
        Ok(())
    }

    /// Releases everything the request holds. Idempotent; returns whether it was active.
    pub fn free(&mut self, request_id: &str) -> bool {
        let Some(active) = self.requests.remove(request_id) else {
            return false;
        };
        Self::release(&mut self.ranks, active);
        true
    }

    fn release(ranks: &mut HashMap<WorkerRank, RankState>, active: Active) {
        let Some(state) = ranks.get_mut(&active.rank) else {
            return;
        };
        state.active_requests -= 1;
        state.prefill_tokens -= active.prefill_tokens;
        state.output_blocks -= active.output_blocks;
        if state.active_requests == 0 {
            state.output_blocks = 0.0; // no float drift once idle
        }
        for h in &active.hashes {
            if let Some(n) = state.blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    state.blocks.remove(h);
                }
            }
        }
    }

    /// Drops requests older than the stale limit; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
        let stale: Vec<String> = self
            .requests
            .iter()
            .filter(|(_, a)| now.saturating_duration_since(a.added) > self.stale_after)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            if let Some(active) = self.requests.remove(id) {
                tracing::warn!(request = %id, worker = active.rank.worker, dp_rank = active.rank.dp_rank, "stale request expired from load accounting");
                Self::release(&mut self.ranks, active);
            }
        }
        stale.len()
    }

    pub fn load(&self, rank: WorkerRank) -> Option<RankLoad> {
        self.ranks.get(&rank).map(|s| RankLoad {
            active_requests: s.active_requests,
            active_prefill_tokens: s.prefill_tokens,
            active_decode_blocks: s.decode_blocks(),
        })
    }

    /// One rank's load if it took a request with these prompt blocks and prefill tokens (an
    /// unknown rank counts as idle).
    pub fn potential_load(
        &self,
        rank: WorkerRank,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
    ) -> PotentialLoad {
        let (prefill, blocks, active, new_blocks) = match self.ranks.get(&rank) {
            Some(s) => (
                s.prefill_tokens,
                s.decode_blocks(),
                s.active_requests,
                hashes.iter().filter(|h| !s.blocks.contains_key(h)).count() as u64,
            ),
            None => (0, 0, 0, hashes.len() as u64),
        };
        PotentialLoad {
            rank,
            potential_prefill_tokens: prefill + new_isl_tokens,
            potential_decode_blocks: blocks + new_blocks,
            active_requests: active,
        }
    }

    /// Every rank's load if it took a request with these prompt blocks and prefill tokens. Blocks
    /// the rank already has active count once.
    pub fn potential_loads(
        &self,
        hashes: &[SequenceHash],
        new_isl_tokens: u64,
    ) -> Vec<PotentialLoad> {
        self.ranks
            .iter()
            .map(|(rank, s)| PotentialLoad {
                rank: *rank,
                potential_prefill_tokens: s.prefill_tokens + new_isl_tokens,
                potential_decode_blocks: s.decode_blocks()
                    + hashes.iter().filter(|h| !s.blocks.contains_key(h)).count() as u64,
                active_requests: s.active_requests,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: WorkerRank = WorkerRank {
        worker: 7,
        dp_rank: 0,
    };
    const B: WorkerRank = WorkerRank {
        worker: 7,
        dp_rank: 1,
    };

    fn h(xs: &[u64]) -> Vec<SequenceHash> {
        xs.iter().map(|x| SequenceHash(*x)).collect()
    }

    fn tracker() -> SlotTracker {
        let mut t = SlotTracker::default();
        t.register(A);
        t.register(B);
        t
    }

    #[test]
    fn output_blocks_weigh_by_decay_and_leave_with_the_request() {
        let mut t = tracker();
        let now = Instant::now();
        t.add("a", A, &h(&[1, 2]), 32, now).unwrap();
        t.add_output_block("a", None).unwrap();
        t.add_output_block("a", Some(0.5)).unwrap();
        t.add_output_block("a", Some(7.0)).unwrap(); // clamped to 1
                                                     // 2 prompt blocks + (1 + 0.5 + 1) output blocks, rounded.
        assert_eq!(t.load(A).unwrap().active_decode_blocks, 2 + 3);
        assert_eq!(
            t.add_output_block("nope", None),
            Err(SlotError::UnknownRequest("nope".into()))
        );
        assert!(t.free("a"));
        assert_eq!(t.load(A).unwrap().active_decode_blocks, 0);
    }

    #[test]
    fn shared_prefixes_count_once() {
        let mut t = tracker();
        let now = Instant::now();
        t.add("a", A, &h(&[1, 2, 3]), 48, now).unwrap();
        t.add("b", A, &h(&[1, 2, 4]), 16, now).unwrap();
        assert_eq!(
            t.load(A),
            Some(RankLoad {
                active_requests: 2,
                active_prefill_tokens: 64,
                active_decode_blocks: 4
            })
        );
        assert!(t.free("a"));
        assert_eq!(t.load(A).unwrap().active_decode_blocks, 3);
        assert!(t.free("b"));
        assert!(!t.free("b"), "free is idempotent");
        assert_eq!(t.load(A), Some(RankLoad::default()));
    }

    #[test]
    fn prefill_completion_and_errors() {
        let mut t = tracker();
        let now = Instant::now();
        t.add("a", B, &h(&[9]), 48, now).unwrap();
        t.prefill_complete("a").unwrap();
        t.prefill_complete("a").unwrap();
        assert_eq!(t.load(B).unwrap().active_prefill_tokens, 0);
        assert_eq!(
            t.add("a", A, &[], 0, now),
            Err(SlotError::DuplicateRequest("a".into()))
        );
        let ghost = WorkerRank {
            worker: 1,
            dp_rank: 0,
        };
        assert_eq!(
            t.add("c", ghost, &[], 0, now),
            Err(SlotError::UnknownRank(ghost))
        );
        assert_eq!(
            t.prefill_complete("zzz"),
            Err(SlotError::UnknownRequest("zzz".into()))
        );
        t.free("a");
        assert_eq!(
            t.load(B),
            Some(RankLoad::default()),
            "no underflow after completion then free"
        );
    }

    #[test]
    fn potential_loads_count_new_blocks_only() {
        let mut t = tracker();
        t.add("a", A, &h(&[1, 2, 3]), 10, Instant::now()).unwrap();
        let mut p = t.potential_loads(&h(&[1, 2, 5, 6]), 32);
        p.sort_by_key(|p| p.rank);
        assert_eq!(
            p[0],
            PotentialLoad {
                rank: A,
                potential_prefill_tokens: 42,
                potential_decode_blocks: 5,
                active_requests: 1
            }
        );
        assert_eq!(
            p[1],
            PotentialLoad {
                rank: B,
                potential_prefill_tokens: 32,
                potential_decode_blocks: 4,
                active_requests: 0
            }
        );
    }

    #[test]
    fn stale_requests_expire_and_unregister_drops_requests() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.add("old", A, &h(&[1]), 5, t0).unwrap();
        t.add("new", A, &h(&[2]), 5, t0 + Duration::from_secs(200))
            .unwrap();
        assert_eq!(t.expire(t0 + Duration::from_secs(299)), 0);
        assert_eq!(t.expire(t0 + Duration::from_secs(301)), 1);
        assert_eq!(
            t.load(A),
            Some(RankLoad {
                active_requests: 1,
                active_prefill_tokens: 5,
                active_decode_blocks: 1
            })
        );
        t.unregister_worker(7);
        assert_eq!(t.load(A), None);
        assert!(!t.free("new"), "the request went with its worker");
        assert_eq!(t.ranks().count(), 0);
    }

    /// Differential test against the simple reference: loads recomputed from scratch from the list of
    /// active requests, after every operation of a random stream.
    #[test]
    fn agrees_with_recomputing_from_active_requests() {
        #[derive(Clone)]
        struct Req {
            rank: WorkerRank,
            hashes: Vec<SequenceHash>,
            prefill: u64,
        }
        let ranks = [
            A,
            B,
            WorkerRank {
                worker: 8,
                dp_rank: 0,
            },
        ];
        let mut rng = fastrand::Rng::with_seed(42);
        let mut t = SlotTracker::default();
        ranks.iter().for_each(|r| t.register(*r));
        let mut reference: HashMap<String, Req> = HashMap::new();
        let now = Instant::now();
        for step in 0..5_000 {
            let id = format!("r{}", rng.u32(..60));
            match rng.u8(..4) {
                0 | 1 => {
                    let rank = ranks[rng.usize(..ranks.len())];
                    // Prompts share prefixes: a common stem of random length, then private blocks.
                    let stem = rng.u64(..4) * 100;
                    let hashes: Vec<SequenceHash> = (0..rng.u64(..6))
                        .map(|i| {
                            SequenceHash(if i < 3 {
                                stem + i
                            } else {
                                rng.u64(..1000) + 10_000
                            })
                        })
                        .collect();
                    let prefill = rng.u64(..100);
                    let r = t.add(&id, rank, &hashes, prefill, now);
                    assert_eq!(r.is_ok(), !reference.contains_key(&id), "step {step}");
                    if r.is_ok() {
                        reference.insert(
                            id,
                            Req {
                                rank,
                                hashes,
                                prefill,
                            },
                        );
                    }
                }
                2 => {
                    assert_eq!(t.prefill_complete(&id).is_ok(), reference.contains_key(&id));
                    if let Some(r) = reference.get_mut(&id) {
                        r.prefill = 0;
                    }
                }
                _ => assert_eq!(t.free(&id), reference.remove(&id).is_some()),
            }
            for rank in ranks {
                let mine: Vec<&Req> = reference.values().filter(|r| r.rank == rank).collect();
                let mut blocks: Vec<SequenceHash> =
                    mine.iter().flat_map(|r| r.hashes.iter().copied()).collect();
                blocks.sort();
                blocks.dedup();
                let want = RankLoad {
                    active_requests: mine.len() as u32,
                    active_prefill_tokens: mine.iter().map(|r| r.prefill).sum(),
                    active_decode_blocks: blocks.len() as u64,
                };
                assert_eq!(t.load(rank), Some(want), "step {step}, rank {rank:?}");
            }
        }
    }
}
