//! KV-aware selection costs, each against a baseline measured in the same run:
//! - index apply (store + remove of 64-block chains) and find-matches (64 blocks; 6,250 blocks with
//!   the table in the caches and after 8 MiB were written), vs the reference index;
//! - a KV-aware pick over 10/100/1000 endpoints for 1k/32k/128k-token prompts, vs the load-only
//!   picker on the same candidates;
//! - approximate (byte-block) hashing of two 400 KiB prompts sharing 392 KiB, and of prompts never
//!   seen before, through the memo of recent texts, beside hashing every block and one xxh3 pass
//!   over the same bytes.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvepp_core::hash::{local_block_hashes, sequence_hashes, LocalBlockHash};
use kvepp_core::index::reference::ReferenceIndex;
use kvepp_core::index::{EngineBlockHash, MatchScratch, PrefixIndex, Tier};
use kvepp_core::kv::worker_id;
use kvepp_core::slots::WorkerRank;
use kvepp_core::{
    Endpoint, KvSettings, KvState, LeastLoaded, PickContext, PickRequest, Picker, PrefixMode,
};

fn chain(seed: u64, n: usize) -> (Vec<LocalBlockHash>, Vec<EngineBlockHash>) {
    let locals: Vec<LocalBlockHash> = (0..n as u64)
        .map(|i| LocalBlockHash(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i))
        .collect();
    let engine = sequence_hashes(&locals)
        .into_iter()
        .map(|s| EngineBlockHash(s.0))
        .collect();
    (locals, engine)
}

fn index(c: &mut Criterion) {
    let mut g = c.benchmark_group("index");
    let ranks: Vec<WorkerRank> = (0..128)
        .map(|w| WorkerRank {
            worker: w,
            dp_rank: 0,
        })
        .collect();
    let chains: Vec<_> = (0..1024).map(|s| chain(s, 64)).collect();
    g.throughput(Throughput::Elements(64 * 2));
    // The same store-then-remove loop for both indexes (they share the method signatures).
    macro_rules! apply_bench {
        ($name:literal, $index:expr) => {
            g.bench_function($name, |b| {
                let mut ix = $index;
                let mut i = 0usize;
                b.iter(|| {
                    let (l, e) = &chains[i % chains.len()];
                    let r = ranks[i % ranks.len()];
                    let _ = ix.store(
                        r,
                        Tier::Device,
                        None,
                        e.iter().copied().zip(l.iter().copied()),
                    );
                    ix.remove(r, Tier::Device, e.iter().rev().copied());
                    i += 1;
                })
            });
        };
    }
    apply_bench!("apply_store_remove_64_blocks/kvepp", PrefixIndex::default());
    apply_bench!(
        "apply_store_remove_64_blocks/reference",
        ReferenceIndex::new(u64::MAX)
    );
    // Every rank holds 1024 chains; half of the ranks also the queried one.
    let mut fast = PrefixIndex::default();
    let mut reference = ReferenceIndex::new(u64::MAX);
    for (k, r) in ranks.iter().enumerate() {
        for s in 0..8 {
            let (l, e) = &chains[(k * 8 + s) % chains.len()];
            let blocks = || e.iter().copied().zip(l.iter().copied());
            let _ = fast.store(*r, Tier::Device, None, blocks());
            let _ = reference.store(*r, Tier::Device, None, blocks());
        }
        if k % 2 == 0 {
            let (l, e) = chain(99_999, 64);
            let _ = fast.store(*r, Tier::Device, None, e.into_iter().zip(l));
            let (l, e) = chain(99_999, 64);
            let _ = reference.store(*r, Tier::Device, None, e.into_iter().zip(l));
        }
    }
    let (l, _) = chain(99_999, 64);
    let query = sequence_hashes(&l);
    g.throughput(Throughput::Elements(1));
    g.bench_function("find_matches_64_blocks_64_holders/kvepp", |b| {
        let mut scratch = MatchScratch::default();
        let mut out = Vec::new();
        b.iter(|| {
            fast.find_matches(black_box(&query), &mut scratch, &mut out);
            out.len()
        })
    });
    g.bench_function("find_matches_64_blocks_64_holders/reference", |b| {
        b.iter(|| reference.overlaps(black_box(&query)).len())
    });
    long_walk(&mut g);
    g.finish();
}

/// A 400 KiB approximate prompt's walk: 6,250 blocks, all held by 4 ranks, in a table of 46k
/// blocks; with the table in the CPU caches, and after 8 MiB were written (as a request's body
/// and buffers pass through them before its pick), beside the reference index.
fn long_walk(g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let mut fast = PrefixIndex::default();
    let mut reference = ReferenceIndex::new(u64::MAX);
    let (l, e) = chain(7, 6_250);
    for w in 0..44u64 {
        let r = WorkerRank {
            worker: w % 4,
            dp_rank: 0,
        };
        let (l, e) = if w < 4 {
            (l.clone(), e.clone())
        } else {
            chain(w, 1_000)
        };
        let _ = fast.store(
            r,
            Tier::Device,
            None,
            e.iter().copied().zip(l.iter().copied()),
        );
        let _ = reference.store(r, Tier::Device, None, e.into_iter().zip(l));
    }
    let query = sequence_hashes(&l);
    let mut scratch = MatchScratch::default();
    let mut out = Vec::new();
    g.bench_function("find_matches_6250_blocks_4_holders/kvepp", |b| {
        b.iter(|| {
            fast.find_matches(black_box(&query), &mut scratch, &mut out);
            out.len()
        })
    });
    let mut junk = vec![0u8; 8 << 20];
    let mut round = 0u8;
    g.bench_function(
        "find_matches_6250_blocks_4_holders/kvepp_after_8MiB_written",
        |b| {
            b.iter_batched(
                || {
                    round = round.wrapping_add(1);
                    junk.iter_mut().step_by(64).for_each(|c| *c = round);
                },
                |()| {
                    fast.find_matches(black_box(&query), &mut scratch, &mut out);
                    out.len()
                },
                criterion::BatchSize::PerIteration,
            )
        },
    );
    g.bench_function("find_matches_6250_blocks_4_holders/reference", |b| {
        b.iter(|| reference.overlaps(black_box(&query)).len())
    });
}

fn endpoints(n: usize) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            let addr: SocketAddr = ([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000).into();
            Arc::new(Endpoint::new(addr, format!("pod-{i}")))
        })
        .collect()
}

fn selection(c: &mut Criterion) {
    let mut g = c.benchmark_group("select");
    g.sample_size(20);
    for n in [10usize, 100, 1000] {
        let eps = endpoints(n);
        let refs: &[Arc<Endpoint>] = &eps;
        for tokens in [1usize << 10, 32 << 10, 128 << 10] {
            let kv = Arc::new(KvState::new(KvSettings::default()));
            let prompt_tokens: Vec<u32> = (0..tokens as u32).collect();
            let prompt = kv.blocks_from_tokens(&prompt_tokens, None, PrefixMode::TokenIds);
            {
                // Every tenth endpoint holds a quarter of the prompt.
                let quarter = prompt_tokens.len() / 4;
                let locals = local_block_hashes(&prompt_tokens[..quarter], 16, None);
                let seqs = sequence_hashes(&locals);
                kv.index().write(|ix| {
                    for e in eps.iter().step_by(10) {
                        let rank = WorkerRank {
                            worker: worker_id(&e.addr_str),
                            dp_rank: 0,
                        };
                        let blocks = seqs
                            .iter()
                            .map(|s| EngineBlockHash(s.0))
                            .zip(locals.iter().copied());
                        let _ = ix.store(rank, Tier::Device, None, blocks);
                    }
                });
            }
            let id = format!("{n}_endpoints/{}k_tokens", tokens >> 10);
            let mut ctx = PickContext::seeded(1);
            g.bench_with_input(BenchmarkId::new("kv_aware", &id), &(), |b, _| {
                b.iter(|| {
                    kv.rank(
                        black_box(refs),
                        &PickRequest::prompt(Some(&prompt)),
                        &mut ctx,
                    )
                    .0
                })
            });
            g.bench_with_input(
                BenchmarkId::new("baseline_least_loaded", &id),
                &(),
                |b, _| {
                    b.iter(|| {
                        LeastLoaded
                            .rank(black_box(refs), &PickRequest::default(), &mut ctx)
                            .best
                    })
                },
            );
        }
    }
    g.finish();
}

fn approximate(c: &mut Criterion) {
    let mut g = c.benchmark_group("approx_hash");
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(400 * 1024 / 45 + 1);
    let bytes = &text.as_bytes()[..400 * 1024];
    // A second prompt that shares its first 392 KiB (the same document, another question after
    // it): the two alternate, so the memo of recent texts reuses the shared part's hashes.
    let mut other = bytes.to_vec();
    for b in &mut other[392 * 1024..] {
        *b ^= 1;
    }
    let settings = KvSettings::default();
    let chunk = (settings.block_size * settings.approx_bytes_per_token) as usize;
    let kv = KvState::new(settings);
    g.throughput(Throughput::Bytes(bytes.len() as u64));
    let mut turn = 0usize;
    g.bench_function("400KiB_392KiB_shared/kvepp_blocks_from_text", |b| {
        b.iter(|| {
            turn += 1;
            let prompt = if turn.is_multiple_of(2) {
                bytes
            } else {
                &other[..]
            };
            kv.blocks_from_text("model", black_box(prompt)).hashes.len()
        })
    });
    // Every prompt unlike any before (its first eight bytes a counter): what remembering costs
    // when the memo never has the prompt's start (one copy of the prompt).
    let mut fresh = bytes.to_vec();
    g.bench_function("400KiB_never_seen/kvepp_blocks_from_text", |b| {
        b.iter(|| {
            turn += 1;
            fresh[..8].copy_from_slice(&(turn as u64).to_le_bytes());
            kv.blocks_from_text("model", black_box(&fresh)).hashes.len()
        })
    });
    g.bench_function("400KiB/every_block_hashed", |b| {
        b.iter(|| {
            let locals: Vec<LocalBlockHash> = black_box(bytes)
                .chunks_exact(chunk)
                .map(|block| LocalBlockHash(xxhash_rust::xxh3::xxh3_64_with_seed(block, 7)))
                .collect();
            sequence_hashes(&locals).len()
        })
    });
    g.bench_function("400KiB/baseline_one_xxh3_pass", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_64(black_box(bytes)))
    });
    g.finish();
}

/// Token ids → block hashes (token-id and tokens modes), beside one xxh3 pass over the same bytes.
fn token_hash(c: &mut Criterion) {
    let mut g = c.benchmark_group("token_hash");
    let ids: Vec<u32> = (0..100_000u32)
        .map(|t| t.wrapping_mul(2_654_435_761) >> 15)
        .collect();
    // Two prompts that share their first 98k tokens (as two variants of a conversation's turn do).
    let mut other = ids.clone();
    for t in &mut other[98_000..] {
        *t ^= 1;
    }
    let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
    let kv = KvState::new(KvSettings::default());
    g.throughput(Throughput::Elements(ids.len() as u64));
    let mut turn = 0usize;
    g.bench_function("100k_ids_98k_shared/kvepp_blocks_from_tokens", |b| {
        b.iter(|| {
            turn += 1;
            let prompt = if turn.is_multiple_of(2) { &ids } else { &other };
            kv.blocks_from_tokens(black_box(prompt), None, PrefixMode::TokenIds)
                .hashes
                .len()
        })
    });
    // The request path makes each prompt's ids (parsing or tokenizing) and is done with them
    // after hashing: lent, the memo copies them; handed over, it keeps them. A copy of the ids
    // stands for making them, in both.
    for owned in [false, true] {
        let name = if owned {
            "100k_ids_98k_shared/ids_made_then_handed_over"
        } else {
            "100k_ids_98k_shared/ids_made_then_lent"
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                turn += 1;
                let prompt = if turn.is_multiple_of(2) { &ids } else { &other };
                let made = black_box(prompt).clone();
                let blocks = if owned {
                    kv.blocks_from_owned_tokens(made, None, PrefixMode::TokenIds)
                } else {
                    kv.blocks_from_tokens(&made, None, PrefixMode::TokenIds)
                };
                blocks.hashes.len()
            })
        });
    }
    g.bench_function("100k_ids/every_block_hashed", |b| {
        b.iter(|| {
            let locals = local_block_hashes(black_box(&ids), 16, None);
            sequence_hashes(&locals).len()
        })
    });
    g.bench_function("100k_ids/baseline_one_xxh3_pass", |b| {
        b.iter(|| xxhash_rust::xxh3::xxh3_64(black_box(&bytes)))
    });
    g.finish();
}

criterion_group!(benches, index, selection, approximate, token_hash);
criterion_main!(benches);
