//! The KV-aware pick (dense buffers, one walk per index, projections from the active-block trees,
//! booking checked by version) against a from-scratch reference: overlaps from the reference
//! index, loads recomputed from the list of booked requests, Dynamo's cost per candidate.

use std::collections::HashSet;

use super::*;
use crate::hash::sequence_hashes;
use crate::index::reference::ReferenceIndex;
use crate::index::{EngineBlockHash, Tier};

fn endpoints(n: u8) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            Arc::new(Endpoint::new(
                ([10, 0, 0, i], 8000).into(),
                format!("pod-{i}"),
            ))
        })
        .collect()
}

/// A prompt from one of four families: a shared stem of random length (below `stem`), then a
/// private tail.
fn prompt(rng: &mut fastrand::Rng, mode: PrefixMode, stem: u64) -> PromptBlocks {
    let family = rng.u64(..4);
    let mut locals: Vec<LocalBlockHash> = (0..rng.u64(..stem))
        .map(|i| LocalBlockHash(family * 1000 + i))
        .collect();
    locals.extend((0..rng.u64(..6)).map(|_| LocalBlockHash(rng.u64(..) | 1 << 63)));
    let hashes = sequence_hashes(&locals);
    PromptBlocks {
        mode,
        isl_tokens: hashes.len() as u64 * 16 + rng.u64(..16),
        locals,
        hashes: hashes.into(),
    }
}

/// A process-local booking of all of `p`'s prompt as prefill, whatever the rank's load.
fn local_slot(p: &PromptBlocks, now: Instant) -> SlotBooking<'static> {
    SlotBooking {
        id: None,
        prefill_tokens: p.isl_tokens,
        held: 0,
        expected: None,
        learn: None,
        decode: None,
        model: None,
        now,
    }
}

#[derive(Debug)]
struct Booked {
    guard: SlotGuard,
    worker: u64,
    hashes: Vec<SequenceHash>,
    prefill: u64,
}

/// What every candidate's score must be, computed the simple way.
fn reference_scores(
    kv: &KvState,
    reference: &ReferenceIndex,
    eps: &[Arc<Endpoint>],
    booked: &[Booked],
    p: &PromptBlocks,
) -> Vec<f64> {
    let found = reference.overlaps(&p.hashes);
    eps.iter()
        .map(|e| {
            let mut overlap = Overlap::default();
            for o in found.iter().filter(|o| o.rank.worker == e.worker) {
                overlap.device = overlap.device.max(o.overlap.device);
                overlap.host = overlap.host.max(o.overlap.host);
                overlap.disk = overlap.disk.max(o.overlap.disk);
            }
            let mine: Vec<&Booked> = booked.iter().filter(|b| b.worker == e.worker).collect();
            let active: HashSet<SequenceHash> =
                mine.iter().flat_map(|b| b.hashes.iter().copied()).collect();
            let new = p.hashes.iter().filter(|h| !active.contains(h)).count() as u64;
            let load = CandidateLoad {
                overlap,
                potential_prefill_tokens: mine.iter().map(|b| b.prefill).sum::<u64>()
                    + p.isl_tokens,
                potential_decode_blocks: active.len() as u64 + new,
                active_requests: mine.len() as u32,
            };
            1.0 / (1.0 + kv.settings().weights.cost(kv.block_size(), &load).max(0.0))
        })
        .collect()
}

/// Short prompts on two data-parallel ranks per endpoint with evictions in the middle of chains
/// (the exact walk; runs gathered per worker).
#[test]
fn kv_aware_scores_equal_a_from_scratch_reference() {
    differential(7, 2, true, 40);
}

/// Long prompts on rank 0 only, evicted from the tail, endpoints leaving the index and their slots
/// reused (the jumping search; each candidate's runs read through its slot hints).
#[test]
fn kv_aware_scores_equal_a_from_scratch_reference_with_jumping_and_slot_hints() {
    differential(8, 1, false, 400);
}

/// Random KV events, picks, bookings and ends; every pick's score per candidate must equal the
/// reference's. `dp_ranks`: ranks per endpoint in the events; `gaps`: evictions anywhere in a
/// chain (else from its tail, as engines evict); `stem`: longest shared prompt stem in blocks.
fn differential(seed: u64, dp_ranks: u32, gaps: bool, stem: u64) {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = endpoints(24);
    let refs: &[Arc<Endpoint>] = &eps;
    let mut reference = ReferenceIndex::new(u64::MAX);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut booked: Vec<Booked> = Vec::new();
    let now = Instant::now();
    let mut compared = 0;
    let mut long_matches = 0;
    // The chains stored per rank and tier (what tail evictions may take back).
    let mut stored: Vec<(WorkerRank, Tier, Vec<SequenceHash>)> = Vec::new();
    for step in 0..4000u64 {
        match rng.u8(..8) {
            0 | 1 => {
                // A KV event: a prompt's chain stored on some rank of some endpoint.
                let p = prompt(&mut rng, PrefixMode::TokenIds, stem);
                let rank = WorkerRank {
                    worker: eps[rng.usize(..eps.len())].worker,
                    dp_rank: rng.u32(..dp_ranks),
                };
                let tier = [Tier::Device, Tier::Host][rng.usize(..2)];
                let blocks: Vec<(EngineBlockHash, LocalBlockHash)> = p
                    .hashes
                    .iter()
                    .map(|s| EngineBlockHash(s.0))
                    .zip(p.locals.iter().copied())
                    .collect();
                let a = kv
                    .index()
                    .write(|ix| ix.store(rank, tier, None, blocks.iter().copied()));
                let b = reference.store(rank, tier, None, blocks.iter().copied());
                assert_eq!(a.is_ok(), b.is_ok());
                stored.push((rank, tier, p.hashes.to_vec()));
            }
            2 if gaps => {
                // An eviction somewhere in a chain (leaves a gap).
                let p = prompt(&mut rng, PrefixMode::TokenIds, stem);
                if let Some(h) = p.hashes.get(rng.usize(..p.hashes.len().max(1))) {
                    let rank = WorkerRank {
                        worker: eps[rng.usize(..eps.len())].worker,
                        dp_rank: rng.u32(..dp_ranks),
                    };
                    let gone = [EngineBlockHash(h.0)];
                    kv.index().write(|ix| ix.remove(rank, Tier::Device, gone));
                    reference.remove(rank, Tier::Device, gone);
                }
            }
            2 if rng.u8(..8) == 0 => {
                // An endpoint leaves the index (its slot is freed, later reused by another).
                let w = eps[rng.usize(..eps.len())].worker;
                kv.index().write(|ix| ix.remove_worker(w));
                reference.remove_worker(w);
                stored.retain(|(r, _, _)| r.worker != w);
            }
            2 if !stored.is_empty() => {
                // An eviction from the tail of a stored chain, as an engine evicts (leaves
                // first: blocks other chains share keep their references).
                let (rank, tier, hashes) = stored.swap_remove(rng.usize(..stored.len()));
                let keep = rng.usize(..hashes.len().max(1));
                let tail: Vec<EngineBlockHash> = hashes[keep..]
                    .iter()
                    .rev()
                    .map(|h| EngineBlockHash(h.0))
                    .collect();
                kv.index()
                    .write(|ix| ix.remove(rank, tier, tail.iter().copied()));
                reference.remove(rank, tier, tail.iter().copied());
                stored.push((rank, tier, hashes[..keep].to_vec()));
            }
            3..=5 => {
                if booked.len() >= 48 {
                    // Bounded, so the reference's recount stays cheap.
                    booked.swap_remove(rng.usize(..booked.len()));
                }
                let p = prompt(&mut rng, PrefixMode::TokenIds, stem);
                long_matches += usize::from(
                    reference
                        .overlaps(&p.hashes)
                        .iter()
                        .any(|o| o.overlap.disk >= crate::index::JUMP_MIN_BLOCKS as u64),
                );
                let mut ctx = PickContext::seeded(step).with_scores();
                let (best, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
                let want = reference_scores(&kv, &reference, &eps, &booked, &p);
                let got = ctx.scores.take().expect("asked for scores");
                assert_eq!(got.len(), want.len());
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() < 1e-12,
                        "step {step}, candidate {i}: {g} vs {w}"
                    );
                }
                compared += 1;
                let guard = kv
                    .book_decision(&eps[best], Some(&p), &d, now)
                    .expect("nothing changed the load since the pick");
                booked.push(Booked {
                    guard,
                    worker: eps[best].worker,
                    hashes: p.hashes.to_vec(),
                    prefill: d.effective_prefill_tokens,
                });
            }
            6 if !booked.is_empty() => {
                let i = rng.usize(..booked.len());
                booked[i].guard.first_byte();
                booked[i].prefill = 0;
            }
            _ if !booked.is_empty() => {
                booked.swap_remove(rng.usize(..booked.len()));
            }
            _ => {}
        }
    }
    assert!(compared > 1000);
    if stem > 2 * crate::index::JUMP_MIN_BLOCKS as u64 {
        assert!(
            long_matches > 100,
            "picks with a long cached prefix: {long_matches}"
        );
    }
    drop(booked);
    assert_eq!(kv.active_count(), 0);
    assert!(kv
        .rank_loads()
        .iter()
        .all(|(_, l)| *l == crate::slots::RankLoad::default()));
}

/// A decision reports the load its cost read, also for a candidate the slot tracker has never
/// seen (its hint misses and it counts as idle) and for one seen since (resolved by its id).
#[test]
fn the_decision_carries_the_chosen_load_also_for_endpoints_new_to_the_tracker() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = endpoints(3);
    let refs: &[Arc<Endpoint>] = &eps;
    let p = prompt(&mut fastrand::Rng::with_seed(2), PrefixMode::TokenIds, 40);
    let mut ctx = PickContext::seeded(3);
    let (_, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
    assert_eq!(d.load_version, None, "never registered");
    assert_eq!(d.potential_prefill_tokens, p.isl_tokens);
    assert_eq!(d.potential_decode_blocks, p.hashes.len() as u64);
    // Registered after the endpoints' hints were last read: found through the tracker's ids.
    for e in &eps {
        kv.register_rank(WorkerRank {
            worker: e.worker,
            dp_rank: 0,
        });
    }
    let (_, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
    assert!(d.load_version.is_some());
    assert_eq!(d.potential_prefill_tokens, p.isl_tokens);
    assert_eq!(d.potential_decode_blocks, p.hashes.len() as u64);
}

/// A booking checked against the version its pick read is refused once another booking changed
/// that endpoint's load, and goes through when nothing did.
#[test]
fn a_booking_is_refused_when_the_load_it_read_changed() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = endpoints(2);
    let refs: &[Arc<Endpoint>] = &eps;
    let p = prompt(&mut fastrand::Rng::with_seed(1), PrefixMode::TokenIds, 40);
    let mut ctx = PickContext::seeded(1);
    let (best, _, first) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
    let (again, _, second) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
    // Unregistered at first (no version) or registered idle by an ordered pick (version 0): a
    // booking reads both as 0.
    assert_eq!(
        first.load_version.unwrap_or(0),
        second.load_version.unwrap_or(0)
    );
    let now = Instant::now();
    let held = kv.book_decision(&eps[best], Some(&p), &first, now);
    assert!(held.is_some());
    if again == best {
        assert!(kv
            .book_decision(&eps[again], Some(&p), &second, now)
            .is_none());
        assert_eq!(kv.booking_conflicts(), 1);
    }
    // Read again: books.
    let (b, _, third) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
    assert!(kv.book_decision(&eps[b], Some(&p), &third, now).is_some());
}

/// A booking keeps the prompt's own hash list (the memo wrote it once, and keeps that very list
/// too): no copy while it is live, and nothing of it kept once it is released.
#[test]
fn a_booking_shares_the_prompts_hash_list() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = endpoints(2);
    let refs: &[Arc<Endpoint>] = &eps;
    let tokens: Vec<u32> = (0..64 * 16).collect();
    let p = kv.blocks_from_tokens(&tokens, None, PrefixMode::Tokens);
    assert_eq!(p.hashes.len(), 64);
    // The request's and the memo's.
    assert_eq!(Arc::strong_count(&p.hashes), 2);
    let mut ctx = PickContext::seeded(1);
    let (best, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
    let guard = kv.book_decision(&eps[best], Some(&p), &d, Instant::now());
    assert!(guard.is_some());
    assert!(
        Arc::strong_count(&p.hashes) > 2,
        "the booking copied the list"
    );
    drop(guard);
    assert_eq!(Arc::strong_count(&p.hashes), 2);
}

/// Threads picking and booking on one state while KV events are applied: every booking is
/// accounted exactly (loads equal the recomputation from the surviving bookings) and nothing is
/// left once they end.
#[test]
fn concurrent_picks_book_exactly() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = Arc::new(endpoints(16));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (kv, eps, stop) = (kv.clone(), eps.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = fastrand::Rng::with_seed(99);
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) || n < 50 {
                let p = prompt(&mut rng, PrefixMode::TokenIds, 40);
                let rank = WorkerRank {
                    worker: eps[rng.usize(..eps.len())].worker,
                    dp_rank: 0,
                };
                let blocks: Vec<_> = p
                    .hashes
                    .iter()
                    .map(|s| EngineBlockHash(s.0))
                    .zip(p.locals.iter().copied())
                    .collect();
                let _ = kv
                    .index()
                    .write(|ix| ix.store(rank, Tier::Device, None, blocks.iter().copied()));
                n += 1;
            }
        })
    };
    let workers: Vec<_> = (0..4u64)
        .map(|t| {
            let (kv, eps) = (kv.clone(), eps.clone());
            std::thread::spawn(move || {
                let refs: &[Arc<Endpoint>] = &eps;
                let mut rng = fastrand::Rng::with_seed(t);
                let mut kept = Vec::new();
                for i in 0..400u64 {
                    let p = prompt(&mut rng, PrefixMode::TokenIds, 40);
                    let mut ctx = PickContext::seeded(t * 1000 + i);
                    // The router's loop: pick again while the chosen load changed.
                    let guard = loop {
                        let (best, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
                        if let Some(g) = kv.book_decision(&eps[best], Some(&p), &d, Instant::now())
                        {
                            break (g, eps[best].worker, d.effective_prefill_tokens);
                        }
                    };
                    if rng.bool() {
                        kept.push((guard, p.hashes));
                    }
                }
                kept
            })
        })
        .collect();
    let kept: Vec<_> = workers
        .into_iter()
        .flat_map(|w| w.join().expect("picker thread"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    writer.join().expect("event thread");
    assert_eq!(kv.active_count(), kept.len());
    for e in eps.iter() {
        let mine: Vec<_> = kept
            .iter()
            .filter(|((_, w, _), _)| *w == e.worker)
            .collect();
        let blocks: HashSet<SequenceHash> =
            mine.iter().flat_map(|(_, h)| h.iter().copied()).collect();
        let want = crate::slots::RankLoad {
            active_requests: mine.len() as u32,
            active_prefill_tokens: mine.iter().map(|((_, _, p), _)| p).sum(),
            active_decode_blocks: blocks.len() as u64,
        };
        assert_eq!(
            kv.load(&e.addr_str).unwrap_or_default(),
            want,
            "endpoint {}",
            e.addr_str
        );
    }
    drop(kept);
    assert_eq!(kv.active_count(), 0);
    assert!(kv
        .rank_loads()
        .iter()
        .all(|(_, l)| *l == crate::slots::RankLoad::default()));
}

/// Approximate mode from several threads, with a small FIFO and an endpoint forgotten on the way:
/// each endpoint's FIFO and its blocks in the approximate index stay the same set, within the
/// cap, and the slot tracker ends empty.
#[test]
fn concurrent_approximate_bookings_keep_fifo_and_index_together() {
    let cap = 48;
    let kv = Arc::new(KvState::new(KvSettings {
        approx_blocks_per_endpoint: cap,
        ..KvSettings::default()
    }));
    let eps = Arc::new(endpoints(8));
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (kv, eps) = (&kv, &eps);
            s.spawn(move || {
                let refs: &[Arc<Endpoint>] = eps;
                let mut rng = fastrand::Rng::with_seed(t + 10);
                for i in 0..300u64 {
                    let p = prompt(&mut rng, PrefixMode::Approximate, 40 + t % 2);
                    let mut ctx = PickContext::seeded(t * 1000 + i);
                    let (best, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
                    drop(kv.book_decision(&eps[best], Some(&p), &d, Instant::now()));
                    if t == 0 && i == 150 {
                        kv.forget(&eps[3].addr_str);
                    }
                }
            });
        }
    });
    assert_eq!(kv.active_count(), 0);
    let ix = kv.approx.index.read();
    let mut recorded = 0;
    for e in eps.iter() {
        let fifo: HashSet<SequenceHash> = kv.approx.fifo_of(e.worker).into_iter().collect();
        let rank = WorkerRank {
            worker: e.worker,
            dp_rank: 0,
        };
        let indexed: HashSet<SequenceHash> = ix.rank_sequences(rank).into_iter().collect();
        assert!(fifo.len() <= cap, "endpoint {}", e.addr_str);
        assert_eq!(fifo, indexed, "endpoint {}", e.addr_str);
        recorded += fifo.len();
    }
    assert!(recorded > 0, "the run recorded blocks");
}

/// What the metrics scraper compares an engine's own request count with: this process's
/// bookings and a peer replica's (applied by replica sync as a reservation), on rank 0.
#[test]
fn worker_requests_count_local_and_peer_bookings() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = endpoints(2);
    assert_eq!(
        kv.worker_requests(eps[0].worker),
        None,
        "not registered yet"
    );
    let p = prompt(&mut fastrand::Rng::with_seed(4), PrefixMode::TokenIds, 40);
    let now = Instant::now();
    let slot = local_slot(&p, now);
    let mine = kv.book(&eps[0], Some(&p), slot);
    assert_eq!(kv.worker_requests(eps[0].worker), Some(1));
    let rank = WorkerRank {
        worker: eps[0].worker,
        dp_rank: 0,
    };
    kv.reserve("peer-1", rank, &p.hashes, p.isl_tokens, now)
        .unwrap();
    assert_eq!(kv.worker_requests(eps[0].worker), Some(2));
    assert_eq!(kv.worker_requests(eps[1].worker), None);
    drop(mine);
    assert_eq!(kv.worker_requests(eps[0].worker), Some(1));
    assert!(kv.free("peer-1"));
    assert_eq!(kv.worker_requests(eps[0].worker), Some(0));
}

/// Requests that stay active (decoding) while more arrive, with bounded loads at `load_bound`,
/// `exempt` (the exempting cached share) and `cached` (the exempt ones' bound): each prompt comes
/// from `next`. Returns the requests per endpoint, the highest ratio of a chosen endpoint's
/// requests (this one included) to the bound's cap, and how many decisions the bound moved.
fn bounded_run(
    knobs: (f64, f64, f64),
    next: impl FnMut(&mut fastrand::Rng) -> PromptBlocks,
) -> ([u32; 4], f64, u32) {
    bounded_run_after(knobs, None, next)
}

/// [`bounded_run`], after `everywhere` (an approximate-mode prompt) was routed once to every
/// endpoint and finished, so each holds it.
fn bounded_run_after(
    (load_bound, exempt, cached): (f64, f64, f64),
    everywhere: Option<&PromptBlocks>,
    mut next: impl FnMut(&mut fastrand::Rng) -> PromptBlocks,
) -> ([u32; 4], f64, u32) {
    let settings = KvSettings {
        weights: CostWeights {
            load_bound,
            load_bound_exempt_cached: exempt,
            load_bound_cached: cached,
            ..CostWeights::dynamo()
        },
        ..KvSettings::default()
    };
    let kv = Arc::new(KvState::new(settings));
    let eps = endpoints(4);
    let refs: &[Arc<Endpoint>] = &eps;
    let mut rng = fastrand::Rng::with_seed(9);
    let mut ctx = PickContext::seeded(4);
    let now = Instant::now();
    if let Some(p) = everywhere {
        for e in &eps {
            let (_, _, d) = kv.rank(
                std::slice::from_ref(e),
                &PickRequest::prompt(Some(p)),
                &mut ctx,
            );
            assert!(kv.book_decision(e, Some(p), &d, now).is_some());
        }
    }
    let mut held = Vec::new();
    let mut counts = [0u32; 4];
    let (mut worst, mut bounded) = (0.0f64, 0);
    for k in 0..24u32 {
        let p = next(&mut rng);
        let (best, _, d) = kv.rank(refs, &PickRequest::prompt(Some(&p)), &mut ctx);
        let cap = (load_bound * f64::from(k + 1) / 4.0).ceil().max(1.0);
        worst = worst.max(f64::from(counts[best] + 1) / cap);
        bounded += u32::from(d.load_bounded);
        counts[best] += 1;
        let mut guard = kv.book_decision(&eps[best], Some(&p), &d, now);
        assert!(guard.is_some());
        // Prefilled: only its decode blocks stay (shared ones counted once).
        if let Some(g) = &mut guard {
            g.first_byte();
        }
        held.push(guard);
    }
    (counts, worst, bounded)
}

/// One prompt sent again and again: without bounded loads its routed prefix keeps the requests
/// on one endpoint; with the bound and no exemption each pick goes to an endpoint then holding at
/// most `ceil(b·(Σ + 1) / n)`, and the decision says when the bound moved it; with the default
/// exemption (half the prompt cached) the holder keeps them.
#[test]
fn bounded_loads_spill_a_hot_prefix_over_unless_its_cache_exempts_it() {
    let mut hot = None;
    let mut same = |rng: &mut fastrand::Rng| {
        hot.get_or_insert_with(|| loop {
            let p = prompt(rng, PrefixMode::Approximate, 400);
            if p.hashes.len() >= 64 {
                break p;
            }
        })
        .clone()
    };
    let (counts, _, bounded) = bounded_run((0.0, 0.5, 0.0), &mut same);
    assert_eq!(bounded, 0);
    assert!(counts.contains(&24), "without the bound: {counts:?}");
    for b in [1.0, 1.25, 1.5] {
        let (counts, worst, bounded) = bounded_run((b, 2.0, 0.0), &mut same);
        assert!(worst <= 1.0, "bound {b}: {counts:?}");
        assert!(bounded > 0, "bound {b}: the bound moved no pick");
        let (counts, _, bounded) = bounded_run((b, 0.5, 0.0), &mut same);
        assert_eq!(
            (counts.contains(&24), bounded),
            (true, 0),
            "bound {b}, exempt"
        );
    }
    // Exempt, but under the cached bound: the holder keeps the prefix until it would hold more
    // than `ceil(c·(Σ + 1) / n)`, then a second engine takes it over (and, holding it too, is
    // bounded likewise); no endpoint ends above `ceil(c · 24 / 4)`.
    for c in [1.0, 1.5, 2.0] {
        let (counts, _, bounded) = bounded_run((1.0, 0.5, c), &mut same);
        let most = counts.iter().copied().max().unwrap_or(0);
        assert!(
            f64::from(most) <= (c * 6.0).ceil() && bounded > 0,
            "cached bound {c}: {counts:?}, {bounded} moved"
        );
        assert!(
            c == 1.0 || most > 6,
            "cached bound {c} keeps affinity: {counts:?}"
        );
    }
}

/// Prompts of very different lengths with nothing cached: Dynamo's cost balances their blocks,
/// so the counts drift apart; a bound of 1 keeps every endpoint within one request of the others.
#[test]
fn bounded_loads_spread_uncached_requests_by_count() {
    let mut n = 0u64;
    let mut fresh = |rng: &mut fastrand::Rng| {
        n += 1;
        let blocks = if n.is_multiple_of(4) { 400 } else { 4 };
        let locals: Vec<LocalBlockHash> = (0..blocks)
            .map(|_| LocalBlockHash(rng.u64(..) | 1 << 63))
            .collect();
        let hashes = sequence_hashes(&locals);
        PromptBlocks {
            mode: PrefixMode::TokenIds,
            isl_tokens: blocks * 16,
            locals,
            hashes: hashes.into(),
        }
    };
    let (counts, worst, _) = bounded_run((0.0, 0.5, 0.0), &mut fresh);
    assert!(
        worst > 1.0,
        "without the bound the counts drift: {counts:?}"
    );
    let (counts, worst, bounded) = bounded_run((1.0, 0.5, 0.0), &mut fresh);
    assert!(worst <= 1.0 && bounded > 0, "{counts:?}");
    assert_eq!(counts, [6; 4]);
}

/// A prefix every endpoint holds (a system prompt all traffic shares) ties the request to none
/// of them: prompts that are mostly that prefix are not exempt from the bound, which spreads
/// them by count as it does cold ones. Before, holding a quarter of the prompt anywhere exempted
/// every endpoint, and Dynamo's cost (which balances blocks) let the counts drift.
#[test]
fn a_prefix_every_endpoint_holds_exempts_none() {
    let stem: Vec<LocalBlockHash> = (0..64).map(LocalBlockHash).collect();
    let with_tail = |tail: Vec<LocalBlockHash>| {
        let locals: Vec<LocalBlockHash> = stem.iter().copied().chain(tail).collect();
        let hashes = sequence_hashes(&locals);
        PromptBlocks {
            mode: PrefixMode::Approximate,
            isl_tokens: hashes.len() as u64 * 16,
            locals,
            hashes: hashes.into(),
        }
    };
    let system = with_tail(Vec::new());
    let mut n = 0u64;
    let mut turns = |rng: &mut fastrand::Rng| {
        n += 1;
        let blocks = if n.is_multiple_of(4) { 160 } else { 4 };
        with_tail(
            (0..blocks)
                .map(|_| LocalBlockHash(rng.u64(..) | 1 << 63))
                .collect(),
        )
    };
    // Without the bound the counts drift; with it, although each endpoint holds over a quarter
    // of every prompt (64 of 68 or of 224 blocks; the exempting share is 0.25), the spread is
    // exact.
    let (counts, worst, _) = bounded_run_after((0.0, 0.25, 0.0), Some(&system), &mut turns);
    assert!(worst > 1.0, "without the bound: {counts:?}");
    let (counts, worst, bounded) = bounded_run_after((1.0, 0.25, 0.0), Some(&system), &mut turns);
    assert!(worst <= 1.0 && bounded > 0, "{counts:?}, {bounded} moved");
    assert_eq!(counts, [6; 4]);
}

/// Approximate prompts go through the memo of recent texts: the same text sent again hashes only
/// its first block, its blocks equal hashing from scratch, and the state's counts include them.
#[test]
fn approximate_blocks_come_from_the_memo_of_recent_texts() {
    let kv = KvState::new(KvSettings::default());
    let text = b"a shared document, sent again. ".repeat(400);
    let first = kv.blocks_from_text("model", &text);
    let before = kv.prompt_hash_stats();
    let again = kv.blocks_from_text("model", &text);
    assert_eq!(again, first);
    let after = kv.prompt_hash_stats();
    let blocks = first.hashes.len() as u64;
    assert!(blocks >= 100, "{blocks} blocks");
    assert_eq!(after.blocks_hashed - before.blocks_hashed, 1);
    assert_eq!(after.blocks_reused - before.blocks_reused, blocks - 1);
    // Another model's blocks are its own.
    assert_ne!(kv.blocks_from_text("other", &text).hashes, first.hashes);
}

/// An endpoint whose KV events stopped decoding is matched, for token prompts, against what was
/// routed to it (recorded at booking), never against what its events said before; the ordered
/// shortcut is off meanwhile. Once its events decode again, the KV-event index alone counts.
#[test]
fn an_endpoint_in_events_fallback_is_matched_by_what_was_routed_to_it() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    kv.set_weights(CostWeights::dynamo());
    let eps = endpoints(2);
    let refs: &[Arc<Endpoint>] = &eps;
    let mut rng = fastrand::Rng::with_seed(7);
    let (q, stale) = (
        prompt(&mut rng, PrefixMode::TokenIds, 40),
        prompt(&mut rng, PrefixMode::TokenIds, 40),
    );
    let rank1 = WorkerRank {
        worker: eps[1].worker,
        dp_rank: 0,
    };
    // What endpoint 1's events said before they stopped decoding.
    let blocks: Vec<_> = stale
        .hashes
        .iter()
        .zip(&stale.locals)
        .map(|(s, l)| (EngineBlockHash(s.0), *l))
        .collect();
    kv.index()
        .write(|ix| ix.store(rank1, Tier::Device, None, blocks.iter().copied()))
        .expect("stored");
    for e in &eps {
        kv.register_rank(e.rank());
    }
    let overlap_on = |p: &PromptBlocks, ctx: &mut PickContext| {
        let req = PickRequest {
            list: Some(1),
            ..PickRequest::prompt(Some(p))
        };
        let (best, _, d) = kv.rank(refs, &req, ctx);
        (best, d.overlap.device)
    };
    let mut ctx = PickContext::seeded(7);
    assert_eq!(overlap_on(&stale, &mut ctx), (1, stale.hashes.len() as u64));
    assert_eq!(kv.pick_paths(), (1, 0), "the ordered shortcut, before");

    assert!(kv.set_events_fallback(eps[1].worker, true));
    assert!(!kv.set_events_fallback(eps[1].worker, true), "already on");
    assert!(kv.in_events_fallback(eps[1].worker));
    let (_, none) = overlap_on(&stale, &mut ctx);
    assert_eq!(
        none, 0,
        "the index's entries of a fallback endpoint are not read"
    );
    // Booked on endpoint 1 and released: recorded as routed there.
    let now = Instant::now();
    let slot = local_slot(&q, now);
    drop(kv.book(&eps[1], Some(&q), slot).expect("booked"));
    for _ in 0..8 {
        assert_eq!(overlap_on(&q, &mut ctx), (1, q.hashes.len() as u64));
    }
    assert_eq!(
        kv.pick_paths(),
        (1, 9),
        "no ordered pick while an endpoint is in fallback"
    );

    // Decoding again: the routed record is not read for token prompts, the index is.
    assert!(kv.set_events_fallback(eps[1].worker, false));
    assert!(!kv.in_events_fallback(eps[1].worker));
    assert_eq!(overlap_on(&q, &mut ctx).1, 0);
    assert_eq!(overlap_on(&stale, &mut ctx), (1, stale.hashes.len() as u64));
    // A forgotten endpoint leaves the fallback set.
    kv.set_events_fallback(eps[0].worker, true);
    kv.remove_worker(eps[0].worker);
    assert!(!kv.in_events_fallback(eps[0].worker));
}

/// Routed prompts recorded at one block size match nothing hashed at another: when the pool's
/// learned block size changes, approximate mode's records go, index and FIFOs together; a report
/// of the size in use keeps what was recorded since.
#[test]
fn approximate_records_go_when_the_learned_block_size_changes() {
    let kv = Arc::new(KvState::new(KvSettings {
        approximate_only: true,
        learn_block_size: true,
        ..KvSettings::default()
    }));
    let eps = endpoints(1);
    let mut rng = fastrand::Rng::with_seed(3);
    let p = prompt(&mut rng, PrefixMode::Approximate, 40);
    let book = |p: &PromptBlocks| {
        let slot = local_slot(p, Instant::now());
        drop(kv.book(&eps[0], Some(p), slot).expect("booked"));
    };
    book(&p);
    let w = eps[0].worker;
    assert!(!kv.approx.fifo_of(w).is_empty());
    assert!(kv.approx.held(w, &p) > 0);
    kv.learn_block_size(w, 32);
    assert_eq!(kv.block_size(), 32);
    assert!(kv.approx.fifo_of(w).is_empty(), "the FIFO went");
    assert_eq!(kv.approx.held(w, &p), 0, "and the index with it");
    book(&p);
    kv.learn_block_size(w, 32);
    assert!(kv.approx.held(w, &p) > 0, "the size in use keeps them");
}

mod ordered;
