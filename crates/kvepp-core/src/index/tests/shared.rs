//! The left-right pair ([`SharedIndex`]) under concurrent readers and writers: whole writes,
//! owed and queued changes, and publications combined across threads.

use super::*;

/// A reader of a [`SharedIndex`] sees each write whole: a chain stored in one write is either
/// absent or entirely there, never in part, while a writer stores and removes it repeatedly.
#[test]
fn shared_index_readers_see_whole_writes() {
    let shared = std::sync::Arc::new(SharedIndex::with_seed(u64::MAX, 5));
    let prompt: Vec<u64> = (0..256).collect();
    let query = seqs(&prompt);
    let rank = wr(1, 0);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (shared, query, stop) = (shared.clone(), query.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = [0u64; 2];
            let (mut scratch, mut out) = (MatchScratch::default(), Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                shared.read().find_matches(&query, &mut scratch, &mut out);
                let got = out.first().map_or(0, |o| o.overlap.device);
                assert!(got == 0 || got == 256, "a partial write was visible: {got}");
                seen[usize::from(got == 256)] += 1;
            }
            seen
        })
    };
    for _ in 0..2000 {
        shared.write(|ix| store_chain(ix, rank, Tier::Device, &prompt));
        shared.write(|ix| {
            ix.remove(
                rank,
                Tier::Device,
                query.iter().map(|h| EngineBlockHash(h.0)),
            )
        });
    }
    // Both copies took every write: a last store is visible, and the spare equals it.
    shared.write(|ix| store_chain(ix, rank, Tier::Device, &prompt));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = reader.join().expect("reader");
    assert!(seen[0] + seen[1] > 0, "the reader ran");
    let first = shared.read().dump();
    shared.write(|_| ());
    assert_eq!(
        shared.read().dump(),
        first,
        "both copies hold the same content"
    );
    assert_eq!(first[0].blocks.len(), 256);
}

/// Writes that leave the old copy owing them (`write_owned`), changes queued for a later
/// publication (`enqueue`, the KV-event path) and writes that wait (`write`), under a reader:
/// readers see every write at once and whole, a write publishes what was queued before it ahead
/// of its own change, the spare catches up before it is written, and both copies end equal to
/// one plain index fed the same changes.
#[test]
fn owed_writes_reach_both_copies_in_order() {
    let shared = std::sync::Arc::new(SharedIndex::with_seed(u64::MAX, 5));
    let mut plain = PrefixIndex::with_seed(u64::MAX, 5);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (shared, stop) = (shared.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::hint::black_box(shared.read().pair_count());
                reads += 1;
            }
            reads
        })
    };
    let mut rng = fastrand::Rng::with_seed(77);
    for step in 0..3000u64 {
        let rank = wr(rng.u64(1..4), 0);
        let chain: Vec<u64> = (0..rng.u64(1..12))
            .map(|i| rng.u64(0..4) * 100 + i)
            .collect();
        let store = rng.bool();
        let apply = move |ix: &mut PrefixIndex| {
            if store {
                store_chain(ix, rank, Tier::Device, &chain);
            } else {
                let hashes = seqs(&chain).into_iter().map(|h| EngineBlockHash(h.0));
                ix.remove(rank, Tier::Device, hashes);
            }
        };
        apply(&mut plain);
        let queued_before = shared.queued();
        match rng.u8(0..8) {
            0 | 1 => {
                shared.write(&apply);
                assert_eq!(
                    shared.owed(),
                    0,
                    "step {step}: a waiting write leaves nothing owed"
                );
            }
            2 => {
                // Queued: published by a later write, in its place before that write's change.
                shared.enqueue(apply, |()| ());
                assert_eq!(shared.queued(), queued_before + 1, "step {step}");
                continue;
            }
            _ => {
                shared.write_owned(apply);
                assert_eq!(shared.owed(), queued_before + 1, "step {step}");
            }
        }
        assert_eq!(
            shared.queued(),
            0,
            "step {step}: a write publishes the queue"
        );
        assert_eq!(
            shared.read().dump(),
            plain.dump(),
            "step {step}: the published copy"
        );
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(reader.join().expect("reader") > 0);
    // The other copy, once it has caught up, holds the same.
    shared.write(|_| ());
    assert_eq!(shared.owed(), 0);
    assert_eq!(shared.read().dump(), plain.dump(), "the caught-up copy");
}

/// Submitted changes from several threads (some queued and flushed in groups, some mixed with
/// plain writes), under a reader: every change is published with its report run exactly once,
/// nothing stays queued, and both copies end equal to a plain index
/// fed every thread's changes (each thread writes its own rank and blocks, so the order between
/// threads does not matter).
#[test]
fn submitted_changes_from_many_threads_are_each_published_once() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let shared = std::sync::Arc::new(SharedIndex::with_seed(u64::MAX, 9));
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let reader = {
        let (shared, stop) = (shared.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::hint::black_box(shared.read().pair_count());
                reads += 1;
            }
            reads
        })
    };
    let ops = |t: u64| {
        let mut rng = fastrand::Rng::with_seed(t);
        (0..1500u64)
            .map(|_| {
                let chain: Vec<u64> = (0..rng.u64(1..10))
                    .map(|i| (t + 1) * 1_000_000 + rng.u64(0..4) * 100 + i)
                    .collect();
                (rng.bool(), chain, rng.u8(0..8))
            })
            .collect::<Vec<_>>()
    };
    let apply = |rank: WorkerRank, store: bool, chain: &[u64], ix: &mut PrefixIndex| {
        if store {
            store_chain(ix, rank, Tier::Device, chain);
        } else {
            let hashes = seqs(chain).into_iter().map(|h| EngineBlockHash(h.0));
            ix.remove(rank, Tier::Device, hashes);
        }
    };
    let reported = std::sync::Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let (shared, reported) = (shared.clone(), reported.clone());
            std::thread::spawn(move || {
                let rank = wr(t + 1, 0);
                let ops = ops(t);
                // How many times each step's report ran.
                let runs: std::sync::Arc<Vec<AtomicU64>> =
                    std::sync::Arc::new(ops.iter().map(|_| AtomicU64::new(0)).collect());
                for (step, (store, chain, how)) in ops.into_iter().enumerate() {
                    let change = move |ix: &mut PrefixIndex| apply(rank, store, &chain, ix);
                    let (runs, reported) = (runs.clone(), reported.clone());
                    let report = move |()| {
                        runs[step].fetch_add(1, Ordering::SeqCst);
                        reported.fetch_add(1, Ordering::SeqCst);
                    };
                    match how {
                        0 => {
                            shared.write_owned(change);
                            report(());
                        }
                        1..=3 => shared.enqueue(change, report),
                        _ => shared.submit(change, report),
                    }
                    if step % 50 == 49 {
                        shared.flush();
                    }
                }
                shared.flush();
                runs
            })
        })
        .collect();
    let runs: Vec<_> = writers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    stop.store(true, Ordering::Relaxed);
    assert!(reader.join().expect("reader") > 0);
    assert_eq!(shared.queued(), 0, "nothing left queued");
    for (t, runs) in runs.iter().enumerate() {
        for (step, n) in runs.iter().enumerate() {
            assert_eq!(
                n.load(Ordering::SeqCst),
                1,
                "thread {t} step {step}: one report"
            );
        }
    }
    assert_eq!(
        reported.load(Ordering::SeqCst),
        4 * 1500,
        "every change reported"
    );
    let mut plain = PrefixIndex::with_seed(u64::MAX, 9);
    for t in 0..4u64 {
        for (store, chain, _) in ops(t) {
            apply(wr(t + 1, 0), store, &chain, &mut plain);
        }
    }
    assert_eq!(shared.read().dump(), plain.dump(), "the published copy");
    shared.write(|_| ());
    assert_eq!(shared.owed(), 0);
    assert_eq!(shared.read().dump(), plain.dump(), "the caught-up copy");
}
