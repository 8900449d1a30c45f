//! Trace replay of the prefix index:
//! K interleaved copies of the Mooncake conversation trace, W workers of C blocks each, routed by
//! `(blocks − overlap) + active` with LRU eviction; every query is answered by `find_matches` in
//! consistent replay (it sees every earlier event) and checked against the generator's own state.
//!
//! `cargo bench --bench index_replay -- [--workers 128 --capacity 16384 --copies 8 --repeat 5]`
//! prints queries/s, ingest events/s and blocks/s, p50/p99/p99.9 find-matches latency and bytes per
//! (block, worker) pair, with the same figures for the simple reference index measured in the same
//! run. `--oracle` checks the generator against its oracle hit ratios. Under `cargo test`
//! (no `--bench`) it replays W=16, C=16384, K=1 once and fails unless the hit ratio is the oracle's
//! and every answer matches. With `KVEPP_REPLAY_PROFILE=1` it also prints what the slowest 1% of
//! queries look like (blocks, longest cached prefix, holders of the first block).
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use kvepp_core::hash::{LocalBlockHash, SequenceHash};
use kvepp_core::index::reference::ReferenceIndex;
use kvepp_core::index::{EngineBlockHash, MatchScratch, PrefixIndex, Tier};
use kvepp_core::slots::WorkerRank;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 128)]
    workers: usize,
    #[arg(long, default_value_t = 16384)]
    capacity: usize,
    #[arg(long, default_value_t = 8)]
    copies: u64,
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Trace file, JSON lines, gzipped when named `.gz` (default: $KVEPP_TRACE, else the
    /// repository's bench/data/conversation_trace.jsonl.gz).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Engines publish vLLM-style hashes of their own instead of ours (costs a map per rank).
    #[arg(long)]
    distinct_engine_hashes: bool,
    /// Check the generator against its oracle hit ratios, then exit.
    #[arg(long)]
    oracle: bool,
    /// Skip the reference index baseline.
    #[arg(long)]
    no_reference: bool,
    /// Passed by `cargo bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn load_trace(path: &std::path::Path) -> anyhow::Result<Vec<Vec<u64>>> {
    #[derive(serde::Deserialize)]
    struct Line {
        hash_ids: Vec<u64>,
    }
    let text = kvepp_test_support::trace::read_text(path)?;
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| Ok(serde_json::from_str::<Line>(l)?.hash_ids))
        .collect()
}

/// One request of the replay and the events its routing produced.
struct Op {
    query: Vec<SequenceHash>,
    /// The generator's overlap of every worker holding the first block: (worker, blocks).
    expect: Vec<(u32, u32)>,
    worker: u32,
    removed: Vec<SequenceHash>,
    parent: Option<SequenceHash>,
    stored: Vec<(SequenceHash, LocalBlockHash)>,
}

struct Workload {
    ops: Vec<Op>,
    workers: Vec<u64>,
    hit: f64,
    query_blocks: u64,
    events: u64,
    event_blocks: u64,
    unique_blocks: usize,
    pairs: usize,
}

#[derive(Default)]
struct Lru {
    held: HashMap<SequenceHash, u64>,
    order: BTreeMap<u64, SequenceHash>,
}

impl Lru {
    fn touch(&mut self, h: SequenceHash, clock: &mut u64) {
        *clock += 1;
        if let Some(old) = self.held.insert(h, *clock) {
            self.order.remove(&old);
        }
        self.order.insert(*clock, h);
    }
}

fn generate(trace: &[Vec<u64>], w: usize, c: usize, k: u64) -> Workload {
    let workers: Vec<u64> = (0..w as u64)
        .map(|i| splitmix64(0x5EED_0000_0000_0000 ^ i))
        .collect();
    let mut caches: Vec<Lru> = (0..w).map(|_| Lru::default()).collect();
    let mut active = vec![0u64; w];
    let mut window: VecDeque<(usize, u64)> = VecDeque::new();
    let mut clock = 0u64;
    let mut ops = Vec::new();
    let (mut matched_total, mut query_blocks, mut events, mut event_blocks) = (0u64, 0u64, 0, 0);
    let mut unique = std::collections::HashSet::new();
    for ids in trace {
        for copy in 0..k {
            if ids.is_empty() {
                continue;
            }
            let locals: Vec<LocalBlockHash> = ids
                .iter()
                .map(|&id| LocalBlockHash(splitmix64(id | copy << 48)))
                .collect();
            let mut query: Vec<SequenceHash> = Vec::with_capacity(locals.len());
            for &l in &locals {
                query.push(SequenceHash::chain(query.last().copied(), l));
            }
            let n = query.len();
            let overlaps: Vec<usize> = caches
                .iter()
                .map(|lru| {
                    query
                        .iter()
                        .take_while(|h| lru.held.contains_key(h))
                        .count()
                })
                .collect();
            let expect = overlaps
                .iter()
                .enumerate()
                .filter(|(_, &o)| o > 0)
                .map(|(i, &o)| (i as u32, o as u32))
                .collect();
            let best = (0..w)
                .min_by_key(|&i| {
                    (
                        (n - overlaps[i]) as u64 + active[i],
                        caches[i].held.len(),
                        i,
                    )
                })
                .unwrap_or(0);
            let m = overlaps[best];
            matched_total += m as u64;
            query_blocks += n as u64;
            active[best] += n as u64;
            window.push_back((best, n as u64));
            if window.len() > 4 * w {
                if let Some((old, blocks)) = window.pop_front() {
                    active[old] -= blocks;
                }
            }
            let lru = &mut caches[best];
            for h in query[..m].iter().rev() {
                lru.touch(*h, &mut clock);
            }
            let keep = n.min(c);
            let new = keep.saturating_sub(m);
            let mut removed = Vec::new();
            while lru.held.len() + new > c {
                let Some((_, h)) = lru.order.pop_first() else {
                    break;
                };
                lru.held.remove(&h);
                removed.push(h);
            }
            for h in query[m..keep].iter().rev() {
                lru.touch(*h, &mut clock);
            }
            for h in query[..m].iter().rev() {
                lru.touch(*h, &mut clock);
            }
            if !removed.is_empty() {
                events += 1;
                event_blocks += removed.len() as u64;
            }
            let stored: Vec<(SequenceHash, LocalBlockHash)> =
                (m..keep).map(|i| (query[i], locals[i])).collect();
            if !stored.is_empty() {
                events += 1;
                event_blocks += stored.len() as u64;
            }
            unique.extend(stored.iter().map(|(s, _)| s.0));
            let parent = m.checked_sub(1).map(|i| query[i]);
            ops.push(Op {
                query,
                expect,
                worker: best as u32,
                removed,
                parent,
                stored,
            });
        }
    }
    let pairs = caches.iter().map(|c| c.held.len()).sum();
    Workload {
        ops,
        workers,
        hit: matched_total as f64 / query_blocks.max(1) as f64,
        query_blocks,
        events,
        event_blocks,
        unique_blocks: unique.len(),
        pairs,
    }
}

fn engine_hash(distinct: bool, s: SequenceHash) -> EngineBlockHash {
    if distinct {
        EngineBlockHash(splitmix64(s.0 ^ 0xD157_1AC7))
    } else {
        EngineBlockHash(s.0)
    }
}

struct Figures {
    p50: f64,
    p99: f64,
    p999: f64,
    qps: f64,
    events_ps: f64,
    blocks_ps: f64,
    table_bytes_per_pair: f64,
    rss_bytes_per_pair: f64,
    pairs: u64,
    blocks: usize,
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or(0) as f64 / 1000.0
}

/// Replays the workload on a fresh [`PrefixIndex`]; checks every answer when `verify`.
fn replay_fast(wl: &Workload, distinct: bool, verify: bool) -> anyhow::Result<Figures> {
    let ranks: Vec<WorkerRank> = wl
        .workers
        .iter()
        .map(|&worker| WorkerRank { worker, dp_rank: 0 })
        .collect();
    let rss0 = rss_bytes();
    let mut index = PrefixIndex::new(u64::MAX);
    for &r in &ranks {
        index.register(r)?;
    }
    let slot_of: HashMap<WorkerRank, u32> = ranks
        .iter()
        .enumerate()
        .map(|(i, &r)| (r, i as u32))
        .collect();
    let mut scratch = MatchScratch::default();
    let mut out = Vec::new();
    let mut lat = Vec::with_capacity(wl.ops.len());
    let mut ingest_ns = 0u128;
    for (n, op) in wl.ops.iter().enumerate() {
        let t = Instant::now();
        index.find_matches(&op.query, &mut scratch, &mut out);
        lat.push(t.elapsed().as_nanos() as u64);

        if verify {
            let mut got: Vec<(u32, u32)> = out
                .iter()
                .map(|o| (slot_of[&o.rank], o.overlap.disk as u32))
                .collect();
            got.sort_unstable();
            anyhow::ensure!(
                got == op.expect,
                "request {n}: index answered {got:?}, generator {:?}",
                op.expect
            );
        }
        let rank = ranks[op.worker as usize];
        let t = Instant::now();
        if !op.removed.is_empty() {
            index.remove(
                rank,
                Tier::Device,
                op.removed.iter().map(|&s| engine_hash(distinct, s)),
            );
        }
        if !op.stored.is_empty() {
            index.store(
                rank,
                Tier::Device,
                op.parent.map(|p| engine_hash(distinct, p)),
                op.stored
                    .iter()
                    .map(|&(s, l)| (engine_hash(distinct, s), l)),
            )?;
        }
        ingest_ns += t.elapsed().as_nanos();
    }
    let rss = rss_bytes().saturating_sub(rss0);
    let pairs = index.pair_count();
    if verify {
        anyhow::ensure!(
            pairs as usize == wl.pairs,
            "pairs {pairs} ≠ generator {}",
            wl.pairs
        );
        let stats = index.stats();
        anyhow::ensure!(
            stats.unknown_parents == 0 && stats.unknown_removals == 0,
            "{stats:?}"
        );
    }
    if std::env::var_os("KVEPP_REPLAY_PROFILE").is_some() {
        let mut idx: Vec<usize> = (0..lat.len()).collect();
        idx.sort_by_key(|&i| std::cmp::Reverse(lat[i]));
        for (name, range) in [("slowest 1%", 0..lat.len() / 100), ("all", 0..lat.len())] {
            let sel = &idx[range];
            let avg = |f: &dyn Fn(&Op) -> usize| {
                sel.iter().map(|&i| f(&wl.ops[i])).sum::<usize>() as f64 / sel.len() as f64
            };
            println!(
                "{name}: {:.0} ns, query {:.1} blocks, max overlap {:.1}, holders of block 0 {:.1}",
                sel.iter().map(|&i| lat[i]).sum::<u64>() as f64 / sel.len() as f64,
                avg(&|o| o.query.len()),
                avg(&|o| o.expect.iter().map(|e| e.1 as usize).max().unwrap_or(0)),
                avg(&|o| o.expect.len()),
            );
        }
    }
    let query_ns: u64 = lat.iter().sum();
    lat.sort_unstable();
    let secs = |ns: f64| ns / 1e9;
    Ok(Figures {
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        p999: percentile(&lat, 0.999),
        qps: lat.len() as f64 / secs(query_ns as f64),
        events_ps: wl.events as f64 / secs(ingest_ns as f64),
        blocks_ps: wl.event_blocks as f64 / secs(ingest_ns as f64),
        table_bytes_per_pair: index.memory_bytes() as f64 / pairs.max(1) as f64,
        rss_bytes_per_pair: rss as f64 / pairs.max(1) as f64,
        pairs,
        blocks: index.block_count(),
    })
}

/// The same replay on the reference index (hash maps, walked rank by rank).
fn replay_reference(wl: &Workload) -> anyhow::Result<(f64, f64)> {
    let ranks: Vec<WorkerRank> = wl
        .workers
        .iter()
        .map(|&worker| WorkerRank { worker, dp_rank: 0 })
        .collect();
    let mut index = ReferenceIndex::new(u64::MAX);
    let (mut query_ns, mut ingest_ns) = (0u128, 0u128);
    for op in &wl.ops {
        let t = Instant::now();
        std::hint::black_box(index.overlaps(&op.query));
        query_ns += t.elapsed().as_nanos();
        let rank = ranks[op.worker as usize];
        let t = Instant::now();
        index.remove(
            rank,
            Tier::Device,
            op.removed.iter().map(|s| EngineBlockHash(s.0)),
        );
        if !op.stored.is_empty() {
            index.store(
                rank,
                Tier::Device,
                op.parent.map(|p| EngineBlockHash(p.0)),
                op.stored.iter().map(|&(s, l)| (EngineBlockHash(s.0), l)),
            )?;
        }
        ingest_ns += t.elapsed().as_nanos();
    }
    Ok((
        wl.ops.len() as f64 / (query_ns as f64 / 1e9),
        wl.event_blocks as f64 / (ingest_ns as f64 / 1e9),
    ))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn trace_path(args: &Args) -> PathBuf {
    args.trace
        .clone()
        .or_else(|| std::env::var_os("KVEPP_TRACE").map(PathBuf::from))
        .unwrap_or_else(kvepp_test_support::trace::mooncake_trace)
}

const ORACLE: [(usize, usize, u64, f64); 4] = [
    (16, 16384, 1, 0.2342),
    (16, 4096, 8, 0.1252),
    (128, 16384, 8, 0.2200),
    (128, 4096, 8, 0.2127),
];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let path = trace_path(&args);
    if !args.bench {
        // `cargo test`: a quick correctness replay of the repository's trace.
        let trace = load_trace(&path)
            .map_err(|e| anyhow::anyhow!("index_replay: trace {}: {e}", path.display()))?;
        let wl = generate(&trace, 16, 16384, 1);
        anyhow::ensure!(
            (wl.hit - ORACLE[0].3).abs() < 5e-5,
            "hit ratio {:.4} ≠ oracle {}",
            wl.hit,
            ORACLE[0].3
        );
        replay_fast(&wl, false, true)?;
        replay_fast(&wl, true, true)?;
        println!(
            "index_replay: W=16 C=16384 K=1 hit {:.4} = oracle; every answer matched",
            wl.hit
        );
        return Ok(());
    }
    let trace = load_trace(&path)?;
    if args.oracle {
        for (w, c, k, want) in ORACLE {
            let wl = generate(&trace, w, c, k);
            let ok = (wl.hit - want).abs() < 5e-5;
            println!(
                "W={w:<4} C={c:<6} K={k}: hit {:.4} (oracle {want}) {}",
                wl.hit,
                if ok { "ok" } else { "MISMATCH" }
            );
            anyhow::ensure!(ok, "generator disagrees with the oracle");
        }
        return Ok(());
    }
    let (w, c, k) = (args.workers, args.capacity, args.copies);
    let t = Instant::now();
    let wl = generate(&trace, w, c, k);
    println!(
        "W={w} C={c} K={k}: {} requests, {} query blocks, hit {:.4}, {} events ({} blocks), {:.2} M unique blocks, {:.2} M (worker, block) pairs at the end [generated in {:.1} s]",
        wl.ops.len(),
        wl.query_blocks,
        wl.hit,
        wl.events,
        wl.event_blocks,
        wl.unique_blocks as f64 / 1e6,
        wl.pairs as f64 / 1e6,
        t.elapsed().as_secs_f64()
    );
    let mut runs = Vec::new();
    for i in 0..args.repeat.max(1) {
        runs.push(replay_fast(&wl, args.distinct_engine_hashes, i == 0)?);
    }
    let m = |f: fn(&Figures) -> f64| median(runs.iter().map(f).collect());
    let (qps, bps) = (m(|f| f.qps), m(|f| f.blocks_ps));
    println!(
        "kvepp PrefixIndex{} (median of {}): find_matches p50 {:.2} / p99 {:.2} / p99.9 {:.2} µs, {:.0} k queries/s; ingest {:.0} k events/s ({:.2} M blocks/s); {:.2} M blocks, {:.2} M pairs, {:.1} B/pair in tables, {:.1} B/pair RSS growth (first run)",
        if args.distinct_engine_hashes { " [distinct engine hashes]" } else { "" },
        runs.len(),
        m(|f| f.p50),
        m(|f| f.p99),
        m(|f| f.p999),
        qps / 1e3,
        m(|f| f.events_ps) / 1e3,
        bps / 1e6,
        runs[0].blocks as f64 / 1e6,
        runs[0].pairs as f64 / 1e6,
        m(|f| f.table_bytes_per_pair),
        runs[0].rss_bytes_per_pair,
    );
    println!(
        "targets (2× Dynamo's best, W=128 C=16384 K=8): ≥ 700 k queries/s, p99 ≤ 5 µs, ≥ 10 M blocks/s, ≤ 45 B/pair"
    );
    if !args.no_reference {
        let (rq, rb) = replay_reference(&wl)?;
        println!(
            "baseline, reference index (hash map per rank, same run): {:.0} k queries/s, {:.2} M blocks/s → kvepp {:.1}× queries/s, {:.1}× blocks/s",
            rq / 1e3,
            rb / 1e6,
            qps / rq,
            bps / rb
        );
    }
    Ok(())
}
