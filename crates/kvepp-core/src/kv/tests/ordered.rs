//! Ordered picks against the scan: on random fleets (loads, index contents in every tier,
//! requests in flight, weights, block sizes, candidate subsets, ranks outside the list), the
//! same choice, runner-up, decision and random draws; the shortcut answers wherever it applies;
//! and on a large fleet it costs few of the candidates.

use super::*;
use crate::hash::sequence_hashes;
use crate::index::{EngineBlockHash, Tier};

fn fleet(n: usize) -> Vec<Arc<Endpoint>> {
    (0..n)
        .map(|i| {
            let addr = ([10, 1, (i >> 8) as u8, i as u8], 8000).into();
            Arc::new(Endpoint::new(addr, format!("pod-{i}")))
        })
        .collect()
}

/// The first `len` blocks of family `family`'s stem, then `tail` private blocks.
fn chain(family: u64, len: u64, tail: u64, rng: &mut fastrand::Rng) -> Vec<LocalBlockHash> {
    let mut l: Vec<LocalBlockHash> = (0..len)
        .map(|i| LocalBlockHash(family * 10_000 + i + 1))
        .collect();
    l.extend((0..tail).map(|_| LocalBlockHash(rng.u64(..) | 1 << 63)));
    l
}

fn prompt(rng: &mut fastrand::Rng, bs: u32) -> PromptBlocks {
    let locals = chain(rng.u64(..3), rng.u64(..40), rng.u64(..4), rng);
    let hashes = sequence_hashes(&locals);
    PromptBlocks {
        mode: PrefixMode::TokenIds,
        isl_tokens: hashes.len() as u64 * u64::from(bs) + rng.u64(..u64::from(bs)),
        locals,
        hashes: hashes.into(),
    }
}

fn rank(e: &Endpoint) -> WorkerRank {
    WorkerRank {
        worker: e.worker,
        dp_rank: 0,
    }
}

/// Random Dynamo weights; every few rounds a setting the shortcut leaves to the scan.
fn weights(round: u64, g: &mut fastrand::Rng) -> CostWeights {
    let pick = |g: &mut fastrand::Rng, xs: &[f64]| xs[g.usize(..xs.len())];
    CostWeights {
        overlap_score_credit: pick(g, &[1.0, 1.0, 0.5, 2.0]),
        host_cache_hit_weight: pick(g, &[0.75, 0.0, 1.0]),
        disk_cache_hit_weight: pick(g, &[0.25, 0.0, 0.5]),
        // 0.7 and 0.3 make sums inexact (ties are then costed, not ruled out).
        prefill_load_scale: pick(g, &[1.0, 1.0, 0.5, 3.0, 0.0, 0.7]),
        decode_active_request_weight: pick(g, &[0.0, 0.0, 1.0, 2.5, 0.3]),
        temperature: if round % 9 == 4 { 0.5 } else { 0.0 },
        load_bound: if round % 7 == 3 { 1.25 } else { 0.0 },
        ..CostWeights::dynamo()
    }
}

/// A fleet of `n` candidates (and a few registered ranks outside the list) with random
/// contents; the state and the endpoints.
/// With `ties`, loads come from a few values (equal costs are common); without, every
/// endpoint has a request or more of its own size. `cached`: the chance in 100 that an
/// endpoint caches a stem.
fn populate(
    g: &mut fastrand::Rng,
    n: usize,
    (w, bs, ties, cached): (CostWeights, u32, bool, u8),
) -> (Arc<KvState>, Vec<Arc<Endpoint>>) {
    let kv = Arc::new(KvState::new(KvSettings {
        weights: w,
        block_size: bs,
        ..KvSettings::default()
    }));
    let eps = fleet(n + 3);
    let now = Instant::now();
    for (k, e) in eps.iter().enumerate() {
        let r = rank(e);
        kv.register_rank(r);
        if g.u8(..100) < cached {
            let l = chain(g.u64(..3), g.u64(1..40), 0, g);
            let h = sequence_hashes(&l);
            let blocks: Vec<(EngineBlockHash, LocalBlockHash)> =
                h.iter().map(|s| EngineBlockHash(s.0)).zip(l).collect();
            let tier = Tier::ALL[g.usize(..3)];
            let _ = kv
                .index()
                .write(|ix| ix.store(r, tier, None, blocks.iter().copied()));
        }
        let requests = if ties { g.usize(..3) } else { g.usize(1..4) };
        for j in 0..requests {
            let l = chain(g.u64(..3), g.u64(..20), g.u64(..3), g);
            let tokens = if ties {
                [0, 64, 256][g.usize(..3)]
            } else {
                g.u64(1..100_000)
            };
            kv.reserve(&format!("r{k}-{j}"), r, &sequence_hashes(&l), tokens, now)
                .unwrap();
            if g.bool() {
                kv.prefill_complete(&format!("r{k}-{j}")).unwrap();
            }
        }
        for _ in 0..g.u32(..3) {
            std::mem::forget(e.load.book());
        }
    }
    (kv, eps)
}

/// Frees the index slots of `two` endpoints' workers and stores a chain for the first again:
/// it takes the slot the second had (the free list's last), so slot numbers now name other
/// workers than the ones the roster's slot map was made from.
fn swap_slots(kv: &KvState, two: &[Arc<Endpoint>], g: &mut fastrand::Rng) {
    let l = chain(g.u64(..3), 30, 0, g);
    let h = sequence_hashes(&l);
    let blocks: Vec<(EngineBlockHash, LocalBlockHash)> =
        h.iter().map(|s| EngineBlockHash(s.0)).zip(l).collect();
    let epoch = kv.index().read().slot_epoch();
    let _ = kv.index().write(|ix| {
        ix.remove_worker(two[0].worker);
        ix.remove_worker(two[1].worker);
        ix.store(rank(&two[0]), Tier::Device, None, blocks.iter().copied())
    });
    assert!(kv.index().read().slot_epoch() > epoch, "the slots changed");
}

/// The ordered pick alone over a named list (None: it left the pick to the scan).
fn ordered(
    kv: &KvState,
    cands: &[Arc<Endpoint>],
    p: &PromptBlocks,
    seed: u64,
) -> Option<crate::kv::ordered::Ordered> {
    let w = kv.weights();
    let (pool, mut sc) = kv.take_scratch(0);
    let mut rng = fastrand::Rng::with_seed(seed);
    let o = kv.rank_ordered(
        cands,
        (Some(p), Some(1)),
        (&w, kv.block_size()),
        &mut rng,
        &mut sc,
    );
    kv.return_scratch(pool, sc);
    o
}

#[test]
fn ordered_picks_choose_as_the_scan_does() {
    let (mut answered, mut orderable, mut compared) = (0, 0, 0);
    for round in 0..400u64 {
        let mut g = fastrand::Rng::with_seed(round);
        let n = g.usize(2..120);
        let w = weights(round, &mut g);
        let bs = [16, 4, 1][g.usize(..3)];
        let (kv, eps) = populate(&mut g, n, (w, bs, true, 40));
        let mut cands: Vec<Arc<Endpoint>> = eps[..n].to_vec();
        if round % 5 == 1 {
            // A subset (at least two), in another order.
            cands.retain(|_| g.u8(..4) > 0);
            cands.extend(
                eps[..2]
                    .iter()
                    .filter(|e| !cands.iter().any(|c| Arc::ptr_eq(c, e)))
                    .cloned()
                    .collect::<Vec<_>>(),
            );
            cands.reverse();
        }
        if round % 13 == 6 {
            // A candidate the slot tracker does not know: the scan counts it idle, the ordered
            // pick registers it (idle) first.
            let addr: std::net::SocketAddr = ([10, 9, 9, 9], 1).into();
            cands.push(Arc::new(Endpoint::new(addr, "new".to_owned())));
        }
        if round % 17 == 8 {
            // The weights change while the state runs: the order is keyed anew.
            kv.set_weights(CostWeights {
                prefill_load_scale: 2.0,
                ..w
            });
        }
        for s in 0..4 {
            if s == 2 && round % 3 == 0 {
                swap_slots(&kv, &eps[..2], &mut g);
            }
            let p = prompt(&mut g, bs);
            let p = (s != 3).then_some(&p);
            // Half the picks name the list, as a pool snapshot does.
            let req = PickRequest {
                list: (s % 2 == 0).then_some(round),
                ..PickRequest::prompt(p)
            };
            let mut a = PickContext::seeded(round * 8 + s);
            let mut b = a.clone();
            kv.set_ordered_picks(true);
            let fast = kv.rank(&cands, &req, &mut a);
            kv.set_ordered_picks(false);
            let scan = kv.rank(&cands, &req, &mut b);
            assert_eq!(fast, scan, "round {round}, pick {s}, {n} candidates, {w:?}");
            assert_eq!(a.rng.u64(..), b.rng.u64(..), "same draws, round {round}");
            compared += 1;
            // Where it applies, the shortcut itself answers (unless ties make it cost more
            // than the scan would), and answers alike.
            let weights = kv.weights();
            if !KvState::orderable(&weights, false, &[]) {
                continue;
            }
            orderable += 1;
            let (pool, mut sc) = kv.take_scratch(0);
            let direct = kv.rank_ordered(
                &cands,
                (p, None),
                (&weights, kv.block_size()),
                &mut PickContext::seeded(round * 8 + s).rng,
                &mut sc,
            );
            kv.return_scratch(pool, sc);
            if let Some(o) = direct {
                assert_eq!((o.best, o.second), (fast.0, fast.1), "round {round}");
                answered += 1;
            }
        }
    }
    assert!(
        answered * 2 > orderable,
        "{answered} of {orderable} orderable picks ({compared} in all) ordered"
    );
}

/// On 3000 candidates with loads of their own, of which a few dozen cache some of the prompt
/// and half have some of it active, the ordered pick costs at most one in twenty and still
/// agrees with the scan, pick after pick as bookings change the loads.
#[test]
fn a_large_fleet_is_picked_from_few_candidates() {
    let mut g = fastrand::Rng::with_seed(7);
    let n = 3000;
    let (kv, eps) = populate(&mut g, n, (CostWeights::dynamo(), 16, false, 2));
    let cands = &eps[..n];
    let mut guards = Vec::new();
    let mut most_held = 0;
    for s in 0..50u64 {
        let p = prompt(&mut g, 16);
        let req = PickRequest::prompt(Some(&p));
        let o = ordered(&kv, cands, &p, s).expect("ordered");
        // Holders of the prompt: cached in the index, or active (bookings of the same stems).
        let holders = {
            let ix = kv.index().read();
            let mut m = MatchScratch::default();
            let mut found = Vec::new();
            ix.find_matches(&p.hashes, &mut m, &mut found);
            let mut held = crate::slots::HeldScratch::default();
            kv.slots.walk_held(&p.hashes, &mut held);
            found.len() + held.holder_count()
        };
        // Half the fleet holds some of it (active bookings of the same stems): the bounds leave
        // a few dozen of them to cost (16 to 91 here).
        assert!(
            o.costed * 20 <= n,
            "costed {} of {n} ({holders} hold some of the prompt)",
            o.costed
        );
        most_held = most_held.max(holders);
        let mut ctx = PickContext::seeded(s);
        let (best, _, d) = kv.rank(cands, &req, &mut ctx);
        assert_eq!(best, o.best);
        kv.set_ordered_picks(false);
        let scan = kv.rank(cands, &req, &mut PickContext::seeded(s));
        kv.set_ordered_picks(true);
        assert_eq!((best, d), (scan.0, scan.2));
        guards.push(
            kv.book_decision(&cands[best], Some(&p), &d, Instant::now())
                .unwrap(),
        );
    }
    assert!(
        most_held > n / 3,
        "the prompts were held widely: {most_held}"
    );
}

/// Through the selector, with the list named: when saturated endpoints are left out (a
/// narrower list than the one named) and when a session's bound rank is ranked alone, the
/// picks stay the scan's.
#[test]
fn a_named_list_narrowed_by_the_selector_picks_as_the_scan_does() {
    use crate::{Admission, KvPicker, Saturation, Selector};
    for round in 0..60u64 {
        let mut g = fastrand::Rng::with_seed(1000 + round);
        let n = g.usize(3..80);
        let (kv, eps) = populate(&mut g, n, (CostWeights::dynamo(), 16, round % 2 == 0, 40));
        let cands = &eps[..n];
        let selector = Selector::new(Box::new(KvPicker(kv.clone())), Saturation::in_flight(2));
        for s in 0..4 {
            let p = prompt(&mut g, 16);
            let sticky = (s == 3).then(|| rank(&cands[g.usize(..n)]));
            let req = PickRequest {
                admission: Admission::Unsaturated,
                list: Some(7),
                sticky,
                ..PickRequest::prompt(Some(&p))
            };
            // A different endpoint saturated at each pick: lists narrowed alike in length but
            // not in members.
            let j = g.usize(..n);
            let _held: Vec<_> = (0..2).map(|_| cands[j].load.book()).collect();
            let mut a = PickContext::seeded(s);
            let mut b = a.clone();
            kv.set_ordered_picks(true);
            let fast = selector.pick(cands, &req, &mut a);
            kv.set_ordered_picks(false);
            let scan = selector.pick(cands, &req, &mut b);
            match (fast, scan) {
                (Ok(x), Ok(y)) => {
                    assert!(Arc::ptr_eq(&x.primary, &y.primary), "round {round}");
                    assert_eq!(x.fallback.map(|e| e.addr), y.fallback.map(|e| e.addr));
                    assert_eq!(x.kv, y.kv);
                }
                (x, y) => assert_eq!(
                    x.map(|p| p.primary.addr).err(),
                    y.map(|p| p.primary.addr).err()
                ),
            }
        }
    }
}

/// An unnamed list is mapped once it comes twice in a row; lists that change from pick to pick
/// (another endpoint left out each time) are scanned, not mapped anew for each pick.
#[test]
fn an_unnamed_list_is_mapped_once_it_comes_twice() {
    let mut g = fastrand::Rng::with_seed(3);
    let n = 40;
    let (kv, eps) = populate(&mut g, n, (CostWeights::dynamo(), 16, false, 10));
    let p = prompt(&mut g, 16);
    let req = PickRequest::prompt(Some(&p));
    let mut ctx = PickContext::seeded(1);
    for k in 0..6 {
        let list: Vec<Arc<Endpoint>> = eps[..n]
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != k)
            .map(|(_, e)| e.clone())
            .collect();
        kv.rank(&list, &req, &mut ctx);
    }
    assert_eq!(kv.pick_paths(), (0, 6), "six different lists, all scanned");
    let list = eps[..n].to_vec();
    for _ in 0..4 {
        kv.rank(&list, &req, &mut ctx);
    }
    assert_eq!(
        kv.pick_paths(),
        (3, 7),
        "the second pick of one list maps it"
    );
}

/// Registers every endpoint and caches the first blocks of `locals` as the pick bench's fleet
/// does: `depths.0` on endpoint 0, `depths.1` on every 16th, `depths.2` on every other even one.
fn cache_like_the_bench(
    kv: &KvState,
    eps: &[Arc<Endpoint>],
    locals: &[LocalBlockHash],
    depths: (usize, usize, usize),
) {
    let hashes = sequence_hashes(locals);
    for (i, e) in eps.iter().enumerate() {
        let r = rank(e);
        kv.register_rank(r);
        let cached = match i {
            0 => depths.0,
            i if i % 16 == 0 => depths.1,
            i if i % 2 == 0 => depths.2,
            _ => 0,
        };
        let blocks: Vec<(EngineBlockHash, LocalBlockHash)> = hashes[..cached]
            .iter()
            .map(|s| EngineBlockHash(s.0))
            .zip(locals[..cached].iter().copied())
            .collect();
        if !blocks.is_empty() {
            let _ = kv
                .index()
                .write(|ix| ix.store(r, Tier::Device, None, blocks.iter().copied()));
        }
    }
}

/// The bench's fleet in small: half of 2000 endpoints cache the prompt's system prompt and
/// have it active, one in 16 caches half the prompt, one most of it, and loads differ (a
/// 200-block prompt: the index walk searches for where its holders change). The
/// levels held by a thousand endpoints are allowed for, not read holder by holder, so the
/// ordered pick costs a handful of candidates and still agrees with the scan, pick after pick
/// as bookings change the loads.
#[test]
fn a_fleet_half_of_which_holds_the_system_prompt_is_picked_from_few() {
    let n = 2000;
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let eps = fleet(n);
    let locals: Vec<LocalBlockHash> = (0..200u64).map(|i| LocalBlockHash(i + 1)).collect();
    let hashes = sequence_hashes(&locals);
    cache_like_the_bench(&kv, &eps, &locals, (190, 120, 60));
    let now = Instant::now();
    let mut g = fastrand::Rng::with_seed(11);
    for (i, e) in eps.iter().enumerate() {
        let r = rank(e);
        let mut mine = if i % 2 == 0 {
            locals[..60].to_vec()
        } else {
            Vec::new()
        };
        mine.extend((0..8).map(|_| LocalBlockHash(g.u64(..) | 1 << 63)));
        kv.reserve(
            &format!("a{i}"),
            r,
            &sequence_hashes(&mine),
            g.u64(64..16_384),
            now,
        )
        .unwrap();
    }
    let p = PromptBlocks {
        mode: PrefixMode::TokenIds,
        isl_tokens: 200 * 16,
        locals: locals.clone(),
        hashes: hashes.clone().into(),
    };
    let mut guards = Vec::new();
    for s in 0..20u64 {
        let o = ordered(&kv, &eps, &p, s).expect("ordered");
        // The picks booked so far have the whole prompt active; a level's bound allows only
        // for what a rank outside the trie's narrow nodes may have (the system prompt's
        // depth), not for their 200 blocks (which had ~35 costed a pick).
        assert!(o.costed * 100 <= n, "pick {s}: costed {} of {n}", o.costed);
        // The picks booked so far have the whole prompt active: each is read in its own
        // narrow node of the trie, not allowed for across the fleet (which would have the
        // walk by load read every rank).
        assert!(
            o.walk_reads * 20 <= n,
            "pick {s}: read {} of {n}",
            o.walk_reads
        );
        let req = PickRequest::prompt(Some(&p));
        let (best, second, d) = kv.rank(&eps, &req, &mut PickContext::seeded(s));
        assert_eq!((best, second), (o.best, o.second), "pick {s}");
        kv.set_ordered_picks(false);
        let scan = kv.rank(&eps, &req, &mut PickContext::seeded(s));
        kv.set_ordered_picks(true);
        assert_eq!((best, second, d), scan, "pick {s}");
        guards.push(kv.book_decision(&eps[best], Some(&p), &d, now).unwrap());
    }
}

/// The bench's default fleet in small, loads equal: one in 16 of 2000 endpoints caches half
/// the prompt, and all of them tie as the runner-up. With sums known exact (Dynamo's weights)
/// a tie that comes after the runner-up in the scan's tie-break (requests in flight, then the
/// earlier candidate) is not costed, so the pick costs a handful, not all 125; with a weight
/// that makes sums inexact (0.7) each tie is costed. Either way the choice, runner-up and
/// decision are the scan's, as bookings and requests in flight break the ties.
#[test]
fn ties_behind_the_runner_up_are_not_costed_when_sums_are_exact() {
    let n = 2000;
    let locals: Vec<LocalBlockHash> = (0..200u64).map(|i| LocalBlockHash(i + 1)).collect();
    let hashes = sequence_hashes(&locals);
    let p = PromptBlocks {
        mode: PrefixMode::TokenIds,
        isl_tokens: 200 * 16,
        locals: locals.clone(),
        hashes: hashes.clone().into(),
    };
    for (w, exact) in [
        (CostWeights::dynamo(), true),
        (
            CostWeights {
                prefill_load_scale: 0.7,
                ..CostWeights::dynamo()
            },
            false,
        ),
    ] {
        let kv = Arc::new(KvState::new(KvSettings {
            weights: w,
            ..KvSettings::default()
        }));
        let eps = fleet(n);
        cache_like_the_bench(&kv, &eps, &locals, (190, 100, 20));
        let now = Instant::now();
        for (i, e) in eps.iter().enumerate() {
            let r = rank(e);
            // One request each, all of one size: the half holders tie exactly.
            let mine = [LocalBlockHash(1 << 62 | i as u64)];
            kv.reserve(&format!("a{i}"), r, &sequence_hashes(&mine), 512, now)
                .unwrap();
        }
        // Requests in flight on two of the tied (the scan's first tie-break).
        let _busy = [eps[16].load.book(), eps[48].load.book()];
        let mut guards = Vec::new();
        let mut alone = 0;
        for s in 0..12u64 {
            let req = PickRequest::prompt(Some(&p));
            let (best, second, d) = kv.rank(&eps, &req, &mut PickContext::seeded(s));
            kv.set_ordered_picks(false);
            let scan = kv.rank(&eps, &req, &mut PickContext::seeded(s));
            kv.set_ordered_picks(true);
            assert_eq!((best, second, d), scan, "pick {s}, exact {exact}");
            if exact {
                let o = ordered(&kv, &eps, &p, s).expect("ordered");
                assert_eq!((o.best, o.second), (best, second));
                // While the deepest holder is cheapest alone; once its bookings make the half
                // holders the cheapest, the random draw among them reads every one.
                if best == 0 {
                    assert!(o.costed <= 12, "pick {s}: costed {}", o.costed);
                    alone += 1;
                }
            }
            guards.push(kv.book_decision(&eps[best], Some(&p), &d, now).unwrap());
            if s == 0 {
                assert_eq!((best, second), (0, Some(32)), "the first tie not in flight");
            }
        }
        let (ordered_picks, _) = kv.pick_paths();
        assert!(
            !exact || (ordered_picks >= alone && alone >= 4),
            "{ordered_picks} ordered, {alone}"
        );
    }
}

/// A level's holders after the index has given their slots to other workers: the roster and
/// its slot map are made again for the new slots, so the holder that took a freed slot is
/// costed as itself and the pick stays the scan's.
#[test]
fn holders_in_slots_given_anew_are_costed_as_themselves() {
    let n = 64;
    let eps = fleet(n);
    let kv = KvState::new(KvSettings::default());
    for e in &eps {
        kv.register_rank(rank(e));
    }
    let locals = chain(1, 12, 0, &mut fastrand::Rng::with_seed(1));
    let hashes = sequence_hashes(&locals);
    let store = |e: &Endpoint, blocks: usize| {
        let b: Vec<(EngineBlockHash, LocalBlockHash)> = hashes[..blocks]
            .iter()
            .map(|s| EngineBlockHash(s.0))
            .zip(locals[..blocks].iter().copied())
            .collect();
        let _ = kv
            .index()
            .write(|ix| ix.store(rank(e), Tier::Device, None, b.iter().copied()));
    };
    let p = PromptBlocks {
        mode: PrefixMode::TokenIds,
        isl_tokens: 12 * 16,
        locals: locals.clone(),
        hashes: hashes.clone().into(),
    };
    let req = PickRequest {
        list: Some(1),
        ..PickRequest::prompt(Some(&p))
    };
    let pick = |seed: u64| {
        kv.set_ordered_picks(true);
        let fast = kv.rank(&eps, &req, &mut PickContext::seeded(seed));
        kv.set_ordered_picks(false);
        let scan = kv.rank(&eps, &req, &mut PickContext::seeded(seed));
        assert_eq!(fast, scan, "pick {seed}");
        fast.0
    };
    // Endpoints 1, 2 and 3 (slots 0, 1, 2) cache 4 blocks: a narrow level, read holder by
    // holder, so the first pick makes the slot map.
    for e in &eps[1..4] {
        store(e, 4);
    }
    pick(1);
    pick(2);
    let made_at = kv.roster_made_at();
    // 1 and 2 leave the index; 9 takes slot 1 (the last freed), then 5 takes slot 0: both
    // cache 8 blocks. 5 is busy, so 9 (whose slot the map gave endpoint 2) is the best.
    kv.index().write(|ix| {
        ix.remove_worker(eps[1].worker);
        ix.remove_worker(eps[2].worker);
    });
    store(&eps[9], 8);
    store(&eps[5], 8);
    assert_eq!(kv.index().read().slot_worker(1), Some(eps[9].worker));
    std::mem::forget(eps[5].load.book());
    let (paths, best) = (kv.pick_paths(), pick(3));
    assert_eq!(best, 9, "the holder of the freed slot");
    assert_eq!(kv.pick_paths().0, paths.0 + 1, "the ordered pick answered");
    assert!(
        kv.roster_made_at() > made_at,
        "the roster (and its slot map) made again for the new slots"
    );
}
