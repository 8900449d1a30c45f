//! The KV-aware pick at scale, each figure beside a baseline measured in the same run.
//!
//! ```sh
//! cargo bench -p kvepp-core --bench pick                      # latency table + 1/2-thread scaling
//! cargo bench -p kvepp-core --bench pick -- --threads 1,2,8,16 --seconds 3
//! cargo bench -p kvepp-core --bench pick -- --no-latency --events-per-second 0   # picks alone
//! valgrind --tool=callgrind target/release/deps/pick-* --bench --endpoints 1000 --tokens-k 128 \
//!     --iterations 300 --no-scaling   # instruction counts, comparable between builds
//! bench/pick_instructions.sh          # instructions per KV-aware pick at 1000 and 4000 endpoints,
//!                                     # ordered and full scan (`--kv-picks N`: the setups and N
//!                                     # picks, nothing else; `--scan`: ordered picks off)
//! cargo bench -p kvepp-core --bench pick -- --holders-every 64   # few endpoints hold the prompt
//! cargo bench -p kvepp-core --bench pick -- --varied-loads       # no two endpoints' loads tie
//! cargo bench -p kvepp-core --bench pick -- --live-bookings 2     # picks with 2 requests of the
//!                                                                 # prompt in flight
//! cargo bench -p kvepp-core --bench pick -- --endpoints 1000 --tokens-k 128 --budget 1 \
//!     --no-scaling --percentiles      # each row's distribution, beside the load-only pick's and
//!                                     # fixed work of the same median (the machine's own tail)
//! ```
//!
//! 1. Latency: p50/p99 of one KV-aware pick (`KvState::rank`) over 10/100/1000/4000 endpoints for
//!    1k/32k/128k-token prompts, against the load-only pick (least loaded) over the same
//!    candidates, and against the same pick reading every candidate (`full scan`: ordered picks
//!    off). Index contents: every even endpoint (every K-th with `--holders-every K`) caches the
//!    prompt's system prompt (a quarter of it, at most 2k tokens), every 16th (8K-th) a half,
//!    endpoint 0 seven eighths, and every endpoint one unrelated 64-block chain; each endpoint has
//!    one active request of 512 tokens (those even ones share the system prompt; with
//!    `--varied-loads`, of 64 to 16k tokens, so loads differ). Also pick + book + release
//!    at each size.
//! 2. Scaling: picks per second from 1, 2, … threads over 1000 endpoints with 32k-token prompts
//!    from 8 families, picks alone and pick + book + release, while another thread applies KV
//!    events (store and remove of 64-block chains) at 1 M blocks/s, against 1 thread × the thread
//!    count (linear).
//!
//! Under `cargo test` (no `--bench`) it runs a small case and checks the pick went where the
//! prompt is cached.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvepp_core::hash::{local_block_hashes, sequence_hashes, LocalBlockHash};
use kvepp_core::index::{EngineBlockHash, Tier};
use kvepp_core::kv::SlotGuard;
use kvepp_core::slots::WorkerRank;
use kvepp_core::{
    Admission, Endpoint, EngineMetrics, KvPicker, KvSettings, KvState, LeastLoaded, PickContext,
    PickRequest, Picker, PrefixMode, PromptBlocks, Saturation, Selector,
};

const BLOCK: usize = 16;

fn endpoints(n: usize) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            let addr: SocketAddr = ([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000).into();
            Arc::new(Endpoint::new(addr, format!("pod-{i}")))
        })
        .collect()
}

fn rank(e: &Endpoint) -> WorkerRank {
    WorkerRank {
        worker: e.worker,
        dp_rank: 0,
    }
}

fn chain(seed: u64, n: usize) -> (Vec<LocalBlockHash>, Vec<EngineBlockHash>) {
    let locals: Vec<LocalBlockHash> = (0..n as u64)
        .map(|i| LocalBlockHash(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i + 1)))
        .collect();
    let engine = sequence_hashes(&locals)
        .into_iter()
        .map(|s| EngineBlockHash(s.0))
        .collect();
    (locals, engine)
}

/// One size of the latency table: the state, its endpoints and the prompt.
struct Setup {
    kv: Arc<KvState>,
    eps: Vec<Arc<Endpoint>>,
    prompt: PromptBlocks,
    /// The `--live-bookings` requests, in flight until the setup is dropped.
    _live: Vec<SlotGuard>,
}

/// `--live-bookings K` (0): after the setup, K picks of the prompt are booked and kept: requests
/// in flight with the whole prompt active, as other threads' bookings are while one picks.
static LIVE_BOOKINGS: AtomicUsize = AtomicUsize::new(0);

/// `--holders-every K` (2): every K-th endpoint caches the system prompt and shares it with
/// its active request, every 8K-th caches half the prompt (a large K: few endpoints hold any of
/// the prompt, the rest are told apart by load alone).
static HOLDERS_EVERY: AtomicUsize = AtomicUsize::new(2);
/// `--varied-loads`: each endpoint's active request has a prompt of its own length (64 to
/// 16k tokens, spread by a hash of its number), so loads differ; else all are 512 tokens and
/// endpoints of one kind tie exactly (every tied candidate must then be costed).
static VARIED: AtomicBool = AtomicBool::new(false);
/// `--scan`: every pick reads every candidate (ordered picks off), the reference.
static SCAN: AtomicBool = AtomicBool::new(false);

fn setup(n: usize, tokens: usize) -> Setup {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    kv.set_ordered_picks(!SCAN.load(Ordering::Relaxed));
    let every = HOLDERS_EVERY.load(Ordering::Relaxed).max(1);
    let eps = endpoints(n);
    let ids: Vec<u32> = (0..tokens as u32)
        .map(|t| t.wrapping_mul(2_654_435_761))
        .collect();
    let prompt = kv.blocks_from_tokens(&ids, None, PrefixMode::TokenIds);
    let system = (tokens / 4).min(2048);
    let locals = local_block_hashes(&ids, BLOCK, None);
    let engine: Vec<EngineBlockHash> = prompt.hashes.iter().map(|h| EngineBlockHash(h.0)).collect();
    let blocks = |t: usize| {
        engine[..t / BLOCK]
            .iter()
            .copied()
            .zip(locals[..t / BLOCK].iter().copied())
    };
    kv.index().write(|ix| {
        for (i, e) in eps.iter().enumerate() {
            let r = rank(e);
            let held = match i {
                0 => tokens * 7 / 8,
                i if i % (8 * every) == 0 => tokens / 2,
                i if i % every == 0 => system,
                _ => 0,
            };
            let _ = ix.store(r, Tier::Device, None, blocks(held));
            let (l, e) = chain(1_000_000 + i as u64, 64);
            let _ = ix.store(r, Tier::Device, None, e.into_iter().zip(l));
        }
    });
    let now = Instant::now();
    for (i, e) in eps.iter().enumerate() {
        let r = rank(e);
        kv.register_rank(r);
        let hashes = if i % every == 0 {
            let mut l = locals[..system / BLOCK].to_vec();
            l.extend(chain(2_000_000 + i as u64, 32).0);
            sequence_hashes(&l)
        } else {
            sequence_hashes(&chain(3_000_000 + i as u64, 64).0)
        };
        let isl = if VARIED.load(Ordering::Relaxed) {
            64 + (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) % 16_384
        } else {
            512
        };
        kv.reserve(&format!("active-{i}"), r, &hashes, isl, now)
            .unwrap();
    }
    // One pick makes the candidate list's roster (once per change of the pool, not per pick).
    let mut ctx = PickContext::seeded(0);
    black_box(kv.rank(&eps, &named(&prompt), &mut ctx));
    let live = (0..LIVE_BOOKINGS.load(Ordering::Relaxed))
        .filter_map(|_| {
            let (best, _, d) = kv.rank(&eps, &named(&prompt), &mut ctx);
            kv.book_decision(&eps[best], Some(&prompt), &d, ctx.now)
        })
        .collect();
    Setup {
        kv,
        eps,
        prompt,
        _live: live,
    }
}

/// A request for `prompt` over the setup's endpoint list, named as a pool snapshot names its
/// list (the list never changes within a setup).
fn named(prompt: &PromptBlocks) -> PickRequest<'_> {
    PickRequest {
        list: Some(1),
        ..PickRequest::prompt(Some(prompt))
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

/// Times `f` once per iteration: (p50, p99) in µs.
fn time(iters: usize, f: impl FnMut()) -> (f64, f64) {
    let d = timings(iters, f);
    (percentile(&d, 0.5), percentile(&d, 0.99))
}

/// The shape of a latency distribution, µs: p10, p50, p90, p95, p98, p99, p99.9.
fn shape(sorted: &[Duration]) -> String {
    [0.1, 0.5, 0.9, 0.95, 0.98, 0.99, 0.999]
        .map(|p| format!("{:.2}", percentile(sorted, p)))
        .join(" | ")
}

/// Times `f` once per iteration (after a warm-up of a tenth as many): the times, sorted.
fn timings(iters: usize, mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..iters / 10 + 1 {
        f();
    }
    let mut d = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f();
        d.push(t.elapsed());
    }
    d.sort_unstable();
    d
}

/// A fixed amount of arithmetic on registers (no memory traffic, no branches that depend on
/// data), `rounds` times.
fn fixed_work(rounds: u64) -> u64 {
    let mut x = black_box(0x9E37_79B9_7F4A_7C15u64);
    for i in 0..rounds {
        x = (x ^ (x >> 29))
            .wrapping_mul(0xBF58_476D_1CE4_E5B9)
            .wrapping_add(i);
    }
    x
}

/// Times of [`fixed_work`] sized so that its median is `p50_us`: what the machine alone does to
/// the tail of a job that length (preemption, interrupts, frequency), to read a pick's tail
/// against. Every iteration does exactly the same work.
fn fixed_work_times(iters: usize, p50_us: f64) -> Vec<Duration> {
    let probe = timings(101, || {
        black_box(fixed_work(black_box(1024)));
    });
    let per_round = percentile(&probe, 0.5) / 1024.0;
    let rounds = ((p50_us / per_round.max(1e-6)) as u64).max(1);
    timings(iters, || {
        black_box(fixed_work(black_box(rounds)));
    })
}

/// How many timed iterations a table row takes: a fixed count, or as many as fit the budget.
#[derive(Clone, Copy)]
enum Sample {
    Budget(Duration),
    Iterations(usize),
}

impl Sample {
    fn iters(self, one: Duration) -> usize {
        match self {
            Sample::Budget(b) => {
                ((b.as_secs_f64() / one.as_secs_f64()) as usize).clamp(200, 20_000)
            }
            Sample::Iterations(n) => n,
        }
    }
}

/// `shapes`: also print each row's distribution (`--percentiles`), to tell a slow tail of the
/// pick from the machine's own (the load-only pick shares the machine, not the work).
fn latency(sizes: &[usize], token_sizes: &[usize], sample: Sample, shapes: bool) {
    println!(
        "## KV-aware pick latency (µs), against the load-only pick over the same candidates\n"
    );
    println!("| endpoints | prompt tokens | KV-aware p50 | KV-aware p99 | load-only p50 | load-only p99 | KV-aware ÷ load-only (p50) | full scan p50 | KV-aware ÷ full scan (p50) | pick+book+release p50 | p99 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut p50 = std::collections::BTreeMap::new();
    let mut distributions = Vec::new();
    for &n in sizes {
        for &tokens in token_sizes {
            let s = setup(n, tokens);
            let refs: &[Arc<Endpoint>] = &s.eps;
            let mut ctx = PickContext::seeded(1);
            // Size the sample to the budget from one timed pick.
            let t = Instant::now();
            black_box(s.kv.rank(refs, &named(&s.prompt), &mut ctx));
            let one = t.elapsed().max(Duration::from_nanos(200));
            let iters = sample.iters(one);
            let kv_times = timings(iters, || {
                black_box(s.kv.rank(black_box(refs), &named(&s.prompt), &mut ctx));
            });
            let base_times = timings(iters, || {
                black_box(LeastLoaded.rank(black_box(refs), &PickRequest::prompt(None), &mut ctx));
            });
            // The same pick reading every candidate (ordered picks off), the reference.
            s.kv.set_ordered_picks(false);
            let scan_times = timings(iters, || {
                black_box(s.kv.rank(black_box(refs), &named(&s.prompt), &mut ctx));
            });
            s.kv.set_ordered_picks(!SCAN.load(Ordering::Relaxed));
            let scan_p50 = percentile(&scan_times, 0.5);
            let kv = (percentile(&kv_times, 0.5), percentile(&kv_times, 0.99));
            let base = (percentile(&base_times, 0.5), percentile(&base_times, 0.99));
            if shapes {
                let k = tokens >> 10;
                distributions.push(format!("| {n} | {k}k | KV-aware | {} |", shape(&kv_times)));
                distributions.push(format!(
                    "| {n} | {k}k | load-only | {} |",
                    shape(&base_times)
                ));
                let fixed = fixed_work_times(iters, kv.0);
                distributions.push(format!(
                    "| {n} | {k}k | fixed work, same p50 | {} |",
                    shape(&fixed)
                ));
            }
            let booked = time(iters, || {
                let (best, _, d) = s.kv.rank(refs, &named(&s.prompt), &mut ctx);
                let g =
                    s.kv.book_decision(&s.eps[best], Some(&s.prompt), &d, ctx.now);
                drop(black_box(g));
            });
            p50.insert((tokens, n), kv.0);
            println!(
                "| {n} | {}k | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}× | {:.2} | {:.2}× | {:.2} | {:.2} |",
                tokens >> 10,
                kv.0,
                kv.1,
                base.0,
                base.1,
                kv.0 / base.0,
                scan_p50,
                kv.0 / scan_p50,
                booked.0,
                booked.1
            );
        }
    }
    println!("\nGrowth of the KV-aware p50 with endpoints (linear would be the endpoint ratio):\n");
    for &tokens in token_sizes {
        let row: Vec<String> = sizes
            .windows(2)
            .filter_map(|w| {
                let a = p50.get(&(tokens, w[0]))?;
                let b = p50.get(&(tokens, w[1]))?;
                Some(format!(
                    "{}→{}: {:.2}× (endpoints {:.0}×)",
                    w[0],
                    w[1],
                    b / a,
                    w[1] as f64 / w[0] as f64
                ))
            })
            .collect();
        println!("- {}k tokens: {}", tokens >> 10, row.join(", "));
    }
    if !distributions.is_empty() {
        println!("\nDistributions (µs):\n");
        println!(
            "| endpoints | prompt tokens | pick | p10 | p50 | p90 | p95 | p98 | p99 | p99.9 |"
        );
        println!("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|");
        for row in distributions {
            println!("{row}");
        }
    }
}

/// The whole selector (eligibility, admission, the KV-aware pick) over 1000 endpoints whose
/// engines all reported fresh, unsaturated metrics, with the default admission (`Shed`) and with
/// flow control's (`Unsaturated`, which checks every candidate's saturation on every pick).
fn admission(tokens: usize, sample: Sample) {
    let n = 1000;
    let s = setup(n, tokens);
    let now = Instant::now();
    let metrics = EngineMetrics {
        waiting: 0.0,
        running: 1.0,
        kv_cache_usage: 0.3,
        ..EngineMetrics::default()
    };
    for e in &s.eps {
        e.load.engine_update(metrics, now);
    }
    // kvepp's defaults (`engine_metrics`: queue 5, KV cache 0.8, stale after 2 s).
    let saturation = Saturation {
        max_in_flight: 0,
        queue_threshold: 5,
        kv_cache_threshold: 0.8,
        stale_after: Some(Duration::from_secs(2)),
    };
    let selector = Selector::new(Box::new(KvPicker(s.kv.clone())), saturation);
    let mut ctx = PickContext::seeded(1);
    let iters = sample.iters(Duration::from_micros(30));
    let mut run = |admission: Admission| {
        let req = PickRequest {
            admission,
            prompt: Some(&s.prompt),
            ..PickRequest::default()
        };
        let picked = selector.pick(&s.eps, &req, &mut ctx);
        assert!(picked.is_ok(), "no endpoint is saturated: {picked:?}");
        time(iters, || {
            black_box(selector.pick(black_box(&s.eps), &req, &mut ctx).is_ok());
        })
    };
    let shed = run(Admission::Shed);
    let unsat = run(Admission::Unsaturated);
    println!(
        "\n## Selector::pick over {n} endpoints, {}k-token prompt: admission without and with flow control (µs)\n",
        tokens >> 10
    );
    println!("| admission | p50 | p99 | p50 ÷ Shed |");
    println!("|---|---:|---:|---:|");
    println!("| Shed (default) | {:.2} | {:.2} | 1.00× |", shed.0, shed.1);
    println!(
        "| Unsaturated (flow control) | {:.2} | {:.2} | {:.2}× |",
        unsat.0,
        unsat.1,
        unsat.0 / shed.0
    );
}

/// What one scaling run measured.
struct ScalingRun {
    picks: f64,
    /// Event blocks per second published.
    events: f64,
    conflicts: u64,
    /// Bookings whose planned trie path went stale before their insertion.
    stale: u64,
    /// Share of the picks that read every candidate (the ordered pick did not apply or gave up).
    scanned: f64,
    /// p99 of an event chain's lag from its arrival to its publication.
    lag_p99_us: f64,
}

/// Picks/s from `threads` threads for `seconds`, with KV events at `event_rate` blocks/s applied
/// by one more thread.
fn scaling_run(
    s: &Arc<Setup2>,
    threads: usize,
    seconds: f64,
    event_rate: f64,
    book: bool,
) -> ScalingRun {
    let stop = Arc::new(AtomicBool::new(false));
    let applied = Arc::new(AtomicU64::new(0));
    // Each event chain's lag from its arrival (queued) to its publication, µs.
    let lags = Arc::new(parking_lot::Mutex::new(Vec::<f64>::new()));
    let conflicts_before = s.kv.booking_conflicts();
    let stale_before = s.kv.stale_booking_plans();
    let paths_before = s.kv.pick_paths();
    let writer = {
        let (s, stop, applied, lags) = (s.clone(), stop.clone(), applied.clone(), lags.clone());
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let due = start.elapsed().as_secs_f64() * event_rate;
                if (applied.load(Ordering::Relaxed) as f64) >= due {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                // As KV-event ingestion writes: the batches at hand (the chains due by now, at
                // most 256) queued, then published together without waiting for the readers of
                // the other copy, which gets them at the next publication.
                let behind = due - applied.load(Ordering::Relaxed) as f64;
                let batch = (behind / 128.0).ceil().clamp(1.0, 256.0) as u64;
                for _ in 0..batch {
                    let r = rank(&s.eps[(i as usize * 7919) % s.eps.len()]);
                    let chain = i as usize % s.event_chains.len();
                    let blocks = 2 * s.event_chains[chain].1.len() as u64;
                    let chains = s.event_chains.clone();
                    let (applied, lags, queued) = (applied.clone(), lags.clone(), Instant::now());
                    s.kv.index().enqueue(
                        move |ix| {
                            let (l, h) = &chains[chain];
                            let _ = ix.store(
                                r,
                                Tier::Device,
                                None,
                                h.iter().copied().zip(l.iter().copied()),
                            );
                            ix.remove(r, Tier::Device, h.iter().rev().copied());
                        },
                        move |()| {
                            applied.fetch_add(blocks, Ordering::Relaxed);
                            lags.lock().push(queued.elapsed().as_secs_f64() * 1e6);
                        },
                    );
                    i += 1;
                }
                s.kv.index().flush();
            }
        })
    };
    let start = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (s, stop) = (s.clone(), stop.clone());
            std::thread::spawn(move || {
                let refs: &[Arc<Endpoint>] = &s.eps;
                let mut ctx = PickContext::seeded(t as u64);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let p = &s.prompts[(n as usize + t * 3) % s.prompts.len()];
                    if !book {
                        black_box(s.kv.rank(refs, &named(p), &mut ctx));
                        n += 1;
                        continue;
                    }
                    let guard = loop {
                        let (best, _, d) = s.kv.rank(refs, &named(p), &mut ctx);
                        if let Some(g) = s.kv.book_decision(&s.eps[best], Some(p), &d, ctx.now) {
                            break g;
                        }
                    };
                    drop(guard);
                    n += 1;
                }
                n
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    stop.store(true, Ordering::Relaxed);
    let picks: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let elapsed = start.elapsed().as_secs_f64();
    writer.join().unwrap();
    let mut lags = std::mem::take(&mut *lags.lock());
    lags.sort_by(f64::total_cmp);
    let p99 = lags.get(lags.len() * 99 / 100).copied().unwrap_or(0.0);
    ScalingRun {
        picks: picks as f64 / elapsed,
        events: applied.load(Ordering::Relaxed) as f64 / elapsed,
        conflicts: s.kv.booking_conflicts() - conflicts_before,
        stale: s.kv.stale_booking_plans() - stale_before,
        scanned: {
            let (o, sc) = s.kv.pick_paths();
            let (o, sc) = (o - paths_before.0, sc - paths_before.1);
            sc as f64 / (o + sc).max(1) as f64
        },
        lag_p99_us: p99,
    }
}

struct Setup2 {
    kv: Arc<KvState>,
    eps: Vec<Arc<Endpoint>>,
    prompts: Vec<PromptBlocks>,
    /// Shared with the index's owed changes (not the whole setup, which holds the index).
    event_chains: Arc<Vec<(Vec<LocalBlockHash>, Vec<EngineBlockHash>)>>,
}

fn scaling(
    thread_counts: &[usize],
    endpoints_n: usize,
    tokens: usize,
    seconds: f64,
    event_rate: f64,
) {
    let base = setup(endpoints_n, tokens);
    // 8 families: the same system prompt, then a family's own document, then a private question.
    let mut rng = fastrand::Rng::with_seed(3);
    let prompts: Vec<PromptBlocks> = (0..64)
        .map(|i| {
            let mut ids: Vec<u32> = (0..tokens as u32 / 4)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            ids.extend((0..tokens as u32 / 2).map(|t| t ^ ((i % 8) << 24)));
            ids.extend((0..tokens / 4).map(|_| rng.u32(..)));
            base.kv.blocks_from_tokens(&ids, None, PrefixMode::TokenIds)
        })
        .collect();
    let s = Arc::new(Setup2 {
        kv: base.kv,
        eps: base.eps,
        prompts,
        event_chains: Arc::new((0..1024).map(|i| chain(5_000_000 + i, 64)).collect()),
    });
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for book in [false, true] {
        println!(
            "\n## Scaling: {} over {endpoints_n} endpoints, {}k-token prompts, KV events at {:.0} k blocks/s ({cores} cores here)\n",
            if book { "pick + book + release" } else { "picks alone (no booking)" },
            tokens >> 10,
            event_rate / 1e3
        );
        println!("| threads | picks/s | per thread | ÷ linear (1 thread × n) | event blocks/s applied | ÷ offered | event lag p99 (µs) | booking conflicts | stale trie plans | picks scanned |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        let mut one = None;
        for &t in thread_counts {
            let r = scaling_run(&s, t, seconds, event_rate, book);
            let single = *one.get_or_insert(r.picks);
            println!(
                "| {t} | {:.0} | {:.0} | {:.2}× | {:.0} | {:.2} | {:.0} | {} | {} | {:.1}% |",
                r.picks,
                r.picks / t as f64,
                r.picks / (single * t as f64),
                r.events,
                r.events / event_rate.max(1.0),
                r.lag_p99_us,
                r.conflicts,
                r.stale,
                r.scanned * 100.0
            );
        }
    }
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

fn list(args: &[String], name: &str, default: &[usize]) -> Vec<usize> {
    arg::<String>(args, name).map_or_else(
        || default.to_vec(),
        |s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
    )
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(k) = arg::<usize>(&args, "--holders-every") {
        HOLDERS_EVERY.store(k, Ordering::Relaxed);
    }
    SCAN.store(args.iter().any(|a| a == "--scan"), Ordering::Relaxed);
    if let Some(k) = arg::<usize>(&args, "--live-bookings") {
        LIVE_BOOKINGS.store(k, Ordering::Relaxed);
    }
    VARIED.store(
        args.iter().any(|a| a == "--varied-loads"),
        Ordering::Relaxed,
    );
    if !args.iter().any(|a| a == "--bench") {
        // `cargo test`: a small case, checked.
        let s = setup(100, 1024);
        let refs: &[Arc<Endpoint>] = &s.eps;
        let (best, _, d) =
            s.kv.rank(refs, &named(&s.prompt), &mut PickContext::seeded(1));
        assert_eq!(
            best, 0,
            "the endpoint caching 7/8 of the prompt wins: {d:?}"
        );
        assert_eq!(d.overlap.device, (1024 * 7 / 8 / BLOCK) as u64);
        scaling(&[1, 2], 100, 1024, 0.05, 1e6);
        println!("pick bench smoke run: ok");
        return;
    }
    let sizes = list(&args, "--endpoints", &[10, 100, 1000, 4000]);
    let tokens: Vec<usize> = list(&args, "--tokens-k", &[1, 32, 128])
        .into_iter()
        .map(|k| k << 10)
        .collect();
    if let Some(picks) = arg::<u64>(&args, "--kv-picks") {
        // For instruction counts (`bench/pick_instructions.sh`): the setup of each size and
        // exactly this many KV-aware picks, nothing else.
        for &n in &sizes {
            for &t in &tokens {
                let s = setup(n, t);
                let refs: &[Arc<Endpoint>] = &s.eps;
                let mut ctx = PickContext::seeded(1);
                for _ in 0..picks {
                    black_box(s.kv.rank(black_box(refs), &named(&s.prompt), &mut ctx));
                }
            }
        }
        return;
    }
    // `--iterations N`: a fixed sample (e.g. under `valgrind --tool=callgrind`, whose
    // instruction counts are then comparable between builds); else `--budget` seconds a row.
    let sample = match arg(&args, "--iterations") {
        Some(n) => Sample::Iterations(n),
        None => Sample::Budget(Duration::from_secs_f64(
            arg(&args, "--budget").unwrap_or(0.4),
        )),
    };
    if !args.iter().any(|a| a == "--no-latency") {
        latency(
            &sizes,
            &tokens,
            sample,
            args.iter().any(|a| a == "--percentiles"),
        );
        admission(32 << 10, sample);
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = list(
        &args,
        "--threads",
        &[1, 2, 4, 8, 16]
            .into_iter()
            .filter(|&t| t <= cores)
            .collect::<Vec<_>>(),
    );
    let seconds = arg(&args, "--seconds").unwrap_or(2.0);
    let events = arg(&args, "--events-per-second").unwrap_or(1e6);
    if !args.iter().any(|a| a == "--no-scaling") {
        scaling(&threads, 1000, 32 << 10, seconds, events);
    }
}
