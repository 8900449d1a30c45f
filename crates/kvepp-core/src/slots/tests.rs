//! The slot tracker: output-block decay, shared prefixes counted once, prefill completion and
//! errors, potential loads, expiry, and a differential test against recomputing the loads from
//! the list of active requests.

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

/// A random prompt of fewer than `max_blocks` blocks sharing prefixes with others: one of
/// `stems` stems (up to 3 blocks), then private blocks. Chained, as the contract says (the
/// projection relies on it).
pub(super) fn chained_prompt(
    rng: &mut fastrand::Rng,
    stems: u64,
    max_blocks: u64,
) -> Vec<SequenceHash> {
    let stem = rng.u64(..stems) * 100;
    let locals: Vec<crate::hash::LocalBlockHash> = (0..rng.u64(..max_blocks))
        .map(|i| {
            crate::hash::LocalBlockHash(if i < 3 {
                stem + i
            } else {
                rng.u64(..1000) + 10_000
            })
        })
        .collect();
    crate::hash::sequence_hashes(&locals)
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
                let hashes = chained_prompt(&mut rng, 4, 6);
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
            let blocks: std::collections::HashSet<SequenceHash> = blocks.into_iter().collect();
            let want = RankLoad {
                active_requests: mine.len() as u32,
                active_prefill_tokens: mine.iter().map(|r| r.prefill).sum(),
                active_decode_blocks: blocks.len() as u64,
            };
            assert_eq!(t.load(rank), Some(want), "step {step}, rank {rank:?}");
            // The projection (binary search over the rank's active blocks) against counting
            // every block of a probe prompt that shares a random stem.
            let probe = crate::hash::sequence_hashes(
                &(0..rng.u64(..8))
                    .map(|i| {
                        crate::hash::LocalBlockHash(if i < 3 {
                            rng.u64(..4) * 100 + i
                        } else {
                            rng.u64(..1000) + 10_000
                        })
                    })
                    .collect::<Vec<_>>(),
            );
            let new_blocks = probe.iter().filter(|h| !blocks.contains(h)).count() as u64;
            assert_eq!(
                t.potential_load(rank, &probe, 7),
                PotentialLoad {
                    rank,
                    potential_prefill_tokens: want.active_prefill_tokens + 7,
                    potential_decode_blocks: want.active_decode_blocks + new_blocks,
                    active_requests: want.active_requests,
                },
                "step {step}, rank {rank:?}"
            );
        }
    }
}
