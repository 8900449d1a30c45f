//! The shared slot tracker: the same answers as the one-lock [`SlotTracker`] on a random stream
//! of operations (differential), and under threads that book, conflict, release and expire at
//! once, loads that always end equal to the sum of the live bookings.

use super::*;
use crate::slots::SlotTracker;

fn rank(worker: u64, dp_rank: u32) -> WorkerRank {
    WorkerRank { worker, dp_rank }
}

/// A prompt sharing a stem with others (the one-lock tracker's tests' generator).
fn prompt(rng: &mut fastrand::Rng) -> Vec<SequenceHash> {
    crate::slots::tests::chained_prompt(rng, 6, 7)
}

/// Every rank's load and a projection of `probe` in both trackers, sorted.
fn same_answers(shared: &SharedSlots, simple: &SlotTracker, probe: &[SequenceHash], step: usize) {
    let mut a = shared.loads();
    let mut b: Vec<_> = simple.loads().collect();
    a.sort_by_key(|(r, _)| *r);
    b.sort_by_key(|(r, _)| *r);
    assert_eq!(a, b, "loads at step {step}");
    assert_eq!(shared.active_count(), simple.active_count(), "step {step}");
    let ranks: Vec<WorkerRank> = b.iter().map(|(r, _)| *r).collect();
    let pa: Vec<_> = shared
        .projections(ranks.iter().copied(), probe, 17)
        .into_iter()
        .map(|(l, _)| l)
        .collect();
    let pb: Vec<_> = simple
        .projections(ranks.iter().copied(), probe, 17)
        .into_iter()
        .map(|(l, _)| l)
        .collect();
    assert_eq!(pa, pb, "projections at step {step}");
}

#[test]
fn agrees_with_the_one_lock_tracker() {
    let mut rng = fastrand::Rng::with_seed(7);
    let shared = SharedSlots::with_seed(Duration::from_secs(300), 99);
    let mut simple = SlotTracker::default();
    let ranks: Vec<WorkerRank> = (0..4)
        .flat_map(|w| (0..2).map(move |d| rank(w, d)))
        .collect();
    let t0 = Instant::now();
    for step in 0..6_000 {
        let id = format!("r{}", rng.u32(..80));
        let r = ranks[rng.usize(..ranks.len())];
        let now = t0 + Duration::from_secs(step as u64 / 20);
        match rng.u8(..10) {
            0 => {
                shared.register(r);
                simple.register(r);
            }
            1..=4 => {
                let hashes = prompt(&mut rng);
                let tokens = rng.u64(..100);
                // Sometimes against the rank's current version, sometimes a stale one.
                let expected = match rng.u8(..3) {
                    0 => None,
                    1 => shared.projection(r, 0, 0, 0).1,
                    _ => Some(rng.u64(..4)),
                };
                let booking = NewRequest {
                    id: id.as_str().into(),
                    hashes: Arc::from(&hashes[..]),
                    new_isl_tokens: tokens,
                    now,
                };
                let hint = shared.dense_id(r).or(Some(rng.u32(..8)));
                let a = shared.add_booking(booking.clone(), r, expected, hint);
                let b = simple.add_booking(booking, r, expected);
                assert_eq!(a, b, "booking at step {step}");
            }
            5 => assert_eq!(
                shared.prefill_complete(&id),
                simple.prefill_complete(&id),
                "step {step}"
            ),
            6 => {
                let w = [None, Some(0.25), Some(f64::NAN), Some(3.0)][rng.usize(..4)];
                assert_eq!(
                    shared.add_output_block(&id, w),
                    simple.add_output_block(&id, w),
                    "step {step}"
                );
            }
            7 | 8 => assert_eq!(shared.free(&id), simple.free(&id), "step {step}"),
            _ if rng.u8(..20) == 0 => {
                let w = rng.u64(..4);
                shared.unregister_workers(&[w]);
                simple.unregister_worker(w);
            }
            _ => {
                let later = now + Duration::from_secs(rng.u64(..400));
                assert_eq!(shared.expire(later), simple.expire(later), "step {step}");
            }
        }
        assert_eq!(shared.is_active(&id), simple.is_active(&id), "step {step}");
        same_answers(&shared, &simple, &prompt(&mut rng), step);
    }
}

/// What one thread of the stress test holds: its live bookings by id, with their rank.
type Held = Vec<(String, WorkerRank)>;

#[test]
fn concurrent_bookings_keep_loads_equal_to_the_live_bookings() {
    const THREADS: usize = 4;
    const STEPS: usize = 4_000;
    let shared = SharedSlots::with_seed(Duration::from_secs(300), 5);
    let ranks: Vec<WorkerRank> = (0..6).map(|w| rank(w, 0)).collect();
    for r in &ranks {
        shared.register(*r);
    }
    let t0 = Instant::now();
    let conflicts = AtomicUsize::new(0);
    let held: Vec<Held> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (shared, ranks, conflicts) = (&shared, &ranks, &conflicts);
                s.spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(t as u64);
                    let mut mine: Held = Vec::new();
                    for step in 0..STEPS {
                        let r = ranks[rng.usize(..ranks.len())];
                        if rng.u8(..3) == 0 && !mine.is_empty() {
                            let (id, _) = mine.swap_remove(rng.usize(..mine.len()));
                            assert!(shared.free(&id), "a live booking frees once");
                            continue;
                        }
                        let id = format!("t{t}-{step}");
                        // Read the load as a pick does, then book expecting it.
                        let hint = shared.dense_id(r);
                        let expected = shared.projection(r, 0, 0, 0).1;
                        let booking = NewRequest {
                            id: id.as_str().into(),
                            hashes: Arc::from(&prompt(&mut rng)[..]),
                            new_isl_tokens: 10,
                            now: t0,
                        };
                        match shared.add_booking(booking, r, expected, hint) {
                            Ok(true) => {
                                if rng.bool() {
                                    shared.prefill_complete(&id).unwrap();
                                }
                                shared.add_output_block(&id, Some(1.0)).unwrap();
                                mine.push((id, r));
                            }
                            Ok(false) => {
                                conflicts.fetch_add(1, Ordering::Relaxed);
                                assert!(!shared.is_active(&id), "a conflict books nothing");
                            }
                            Err(e) => panic!("booking failed: {e}"),
                        }
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The invariant: each rank's requests are exactly the live bookings on it, and its prompt
    // blocks the distinct blocks of their prompts (checked by rebuilding in the simple tracker
    // is not possible without the prompts, so by count, then by freeing everything).
    let live: Vec<&(String, WorkerRank)> = held.iter().flatten().collect();
    assert_eq!(shared.active_count(), live.len());
    for r in &ranks {
        let on_rank = live.iter().filter(|(_, x)| x == r).count() as u32;
        assert_eq!(shared.load(*r).unwrap().active_requests, on_rank, "{r:?}");
    }
    for (id, _) in &live {
        assert!(shared.free(id));
    }
    for r in &ranks {
        assert_eq!(shared.load(*r), Some(RankLoad::default()), "{r:?} idle");
    }
    assert_eq!(shared.active_count(), 0);
    for t in shared.tries.iter() {
        assert_eq!(t.read().node_count(), 1, "only the root is left");
    }
    // Conflicts happen only where two threads met on a rank; the stream books most of the time.
    assert!(conflicts.load(Ordering::Relaxed) < THREADS * STEPS / 2);
}

#[test]
fn unregistering_under_bookings_leaves_nothing_behind() {
    let shared = SharedSlots::with_seed(Duration::from_secs(300), 3);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let shared = &shared;
        for t in 0..3u64 {
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(t);
                for step in 0..2_000 {
                    let r = rank(rng.u64(..3), 0);
                    let hint = shared.register(r);
                    let booking = NewRequest {
                        id: format!("t{t}-{step}").into(),
                        hashes: Arc::from(&prompt(&mut rng)[..]),
                        new_isl_tokens: 5,
                        now: t0,
                    };
                    // A rank unregistered between the two calls is refused, never half booked.
                    match shared.add_booking(booking, r, None, hint) {
                        Ok(true) | Err(SlotError::UnknownRank(_)) => {}
                        other => panic!("unexpected {other:?}"),
                    }
                }
            });
        }
        s.spawn(move || {
            for i in 0..300u64 {
                shared.unregister_workers(&[i % 3]);
            }
        });
    });
    // All three at once: one pass removes every one's requests.
    shared.unregister_workers(&[0, 1, 2]);
    assert_eq!(shared.active_count(), 0);
    assert!(shared.ranks().is_empty());
    for t in shared.tries.iter() {
        assert_eq!(t.read().node_count(), 1, "only the root is left");
    }
    assert_eq!(shared.expire(t0 + Duration::from_secs(1_000)), 0);
}

#[test]
fn a_hint_spares_the_rank_map_only_when_it_still_names_the_rank() {
    let shared = SharedSlots::with_seed(Duration::from_secs(300), 1);
    let (a, b) = (rank(1, 0), rank(2, 0));
    let ia = shared.register(a).unwrap();
    assert_eq!(shared.register_at(a, ia), Some(ia));
    // A hint naming another rank, a free id or none at all: the map decides.
    let ib = shared.register_at(b, ia).unwrap();
    assert_ne!(ia, ib);
    assert_eq!(shared.register_at(b, 4_000_000), Some(ib));
    shared.unregister_workers(&[1]);
    assert_eq!(shared.dense_id(a), None);
    let again = shared.register_at(a, ia).unwrap();
    assert_eq!(
        shared.dense_id(a),
        Some(again),
        "registered anew, not taken from the hint"
    );
    assert_eq!(shared.load(a), Some(RankLoad::default()));
}

/// A writer publishing states whose fields keep a relation, readers checking it in every view
/// they read: a torn view (fields from two publications) would break it.
#[test]
fn views_are_never_torn() {
    let cell = RankCell::default();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let (cell, stop) = (&cell, &stop);
        s.spawn(move || {
            for k in 1..=20_000u32 {
                let mut state = cell.state.lock();
                let st = state.get_or_insert_with(|| RankState::new(rank(9, 0)));
                st.active_requests = k;
                st.prefill_tokens = 10 * u64::from(k);
                st.blocks = 3 * u64::from(k);
                st.version = u64::from(k);
                cell.publish(
                    &state
                        .as_ref()
                        .map_or_else(RankView::default, RankState::view),
                );
            }
            stop.store(true, Ordering::Relaxed);
        });
        for _ in 0..2 {
            s.spawn(move || {
                let mut seen = 0;
                while !stop.load(Ordering::Relaxed) {
                    let v = cell.view();
                    let k = u64::from(v.active_requests);
                    assert_eq!(v.prefill_tokens, 10 * k, "{v:?}");
                    assert_eq!(v.decode_blocks, 3 * k, "{v:?}");
                    assert_eq!(v.version, k, "{v:?}");
                    assert!(v.version >= seen, "views never go back");
                    seen = v.version;
                }
            });
        }
    });
    assert_eq!(cell.view().active_requests, 20_000);
}

/// The load order under threads that book, complete prefills, free and unregister while
/// another visits (raising stale chunk bounds as it goes): once they stop, every rank's key is
/// its load's, the least key's bound holds, and a visit yields exactly the ranks whose keys are
/// within its limit.
#[test]
fn the_load_order_yields_exactly_the_keys_within_a_limit_after_concurrent_changes() {
    let slots = SharedSlots::with_seed(Duration::from_secs(3600), 5);
    let p = KeyParams {
        prefill_load_scale: 1.5,
        block_size: 16,
        per_request: 0.5,
    };
    let ranks: Vec<WorkerRank> = (0..700).map(|w| rank(w, 0)).collect();
    for &r in &ranks {
        slots.register(r);
    }
    assert!(slots.keyed_by(&p));
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let (slots, stop) = (&slots, &stop);
        s.spawn(move || {
            let mut rng = fastrand::Rng::with_seed(99);
            while !stop.load(Ordering::Relaxed) {
                slots.visit_by_load(rng.f64() * 400.0, &mut VisitScratch::default(), |_, _| {
                    rng.f64() * 400.0
                });
            }
        });
        let bookers: Vec<_> = (0..3u64)
            .map(|t| {
                let ranks = &ranks;
                s.spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(t);
                    let now = Instant::now();
                    let mut live: Vec<String> = Vec::new();
                    for step in 0..20_000 {
                        let r = ranks[rng.usize(..ranks.len())];
                        match rng.u8(..6) {
                            0..=2 => {
                                let id = format!("{t}-{step}");
                                let tokens = rng.u64(..5000);
                                if slots.add(&id, r, &prompt(&mut rng), tokens, now).is_ok() {
                                    live.push(id);
                                }
                            }
                            3 if !live.is_empty() => {
                                let _ = slots.prefill_complete(&live[rng.usize(..live.len())]);
                            }
                            4 if !live.is_empty() => {
                                let id = live.swap_remove(rng.usize(..live.len()));
                                slots.free(&id);
                            }
                            5 if t == 0 && step % 300 == 0 => {
                                slots.unregister_workers(&[r.worker]);
                                slots.register(r);
                            }
                            _ => {}
                        }
                    }
                })
            })
            .collect();
        for b in bookers {
            b.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    let key = |l: RankLoad| {
        1.5 * (l.active_prefill_tokens as f64 * (1.0 / 16.0))
            + l.active_decode_blocks as f64
            + 0.5 * f64::from(l.active_requests)
    };
    let mut keys: Vec<(u32, f64)> = ranks
        .iter()
        .map(|&r| {
            let id = slots.dense_id(r).unwrap();
            let want = key(slots.load(r).unwrap());
            assert_eq!(slots.load_key(id), want, "{r:?}");
            (id, want)
        })
        .collect();
    keys.sort_by_key(|k| k.0);
    let least = keys.iter().map(|k| k.1).fold(f64::INFINITY, f64::min);
    assert!(slots.least_key() <= least);
    let mut rng = fastrand::Rng::with_seed(7);
    let mut scratch = VisitScratch::default();
    for _ in 0..200 {
        let limit = rng.f64() * 300.0;
        let mut seen = Vec::new();
        slots.visit_by_load(limit, &mut scratch, |id, k| {
            seen.push((id, k));
            limit
        });
        assert!(seen.windows(2).all(|w| w[0].1 <= w[1].1), "least key first");
        seen.sort_by_key(|k| k.0);
        let want: Vec<(u32, f64)> = keys.iter().copied().filter(|k| k.1 <= limit).collect();
        assert_eq!(seen, want, "limit {limit}");
    }
}
