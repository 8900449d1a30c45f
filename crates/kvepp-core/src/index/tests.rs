use super::reference::ReferenceIndex;
use super::*;
use crate::hash::sequence_hashes;

pub(super) fn wr(worker: u64, dp_rank: u32) -> WorkerRank {
    WorkerRank { worker, dp_rank }
}

pub(super) fn seqs(locals: &[u64]) -> Vec<SequenceHash> {
    let l: Vec<LocalBlockHash> = locals.iter().map(|&h| LocalBlockHash(h)).collect();
    sequence_hashes(&l)
}

fn od(device: u64, host: u64, disk: u64) -> Overlap {
    Overlap { device, host, disk }
}

fn sorted(mut v: Vec<RankOverlap>) -> Vec<RankOverlap> {
    v.sort_by_key(|o| o.rank);
    v
}

/// Stores `locals` as one sequence from its start, engine hash = our hash.
pub(super) fn store_chain(
    ix: &mut PrefixIndex,
    rank: WorkerRank,
    tier: Tier,
    locals: &[u64],
) -> usize {
    let s = seqs(locals);
    ix.store(
        rank,
        tier,
        None,
        s.iter()
            .zip(locals)
            .map(|(s, &l)| (EngineBlockHash(s.0), LocalBlockHash(l))),
    )
    .unwrap()
}

#[test]
fn longest_prefix_per_rank_with_tiers() {
    let mut ix = PrefixIndex::default();
    let (a, b, c) = (wr(1, 0), wr(2, 0), wr(2, 1));
    store_chain(&mut ix, a, Tier::Device, &[1, 2, 3, 4]);
    store_chain(&mut ix, b, Tier::Device, &[1, 2]);
    store_chain(&mut ix, b, Tier::Host, &[1, 2, 3]);
    store_chain(&mut ix, c, Tier::Disk, &[1, 2, 3, 4, 5]);
    // c also has a later block but misses the first: no prefix at all.
    let q = seqs(&[1, 2, 3, 4, 5, 6]);
    let got = sorted(ix.overlaps(&q));
    assert_eq!(
        got,
        vec![
            RankOverlap {
                rank: a,
                overlap: od(4, 4, 4)
            },
            RankOverlap {
                rank: b,
                overlap: od(2, 3, 3)
            },
            RankOverlap {
                rank: c,
                overlap: od(0, 0, 5)
            },
        ]
    );
    // A different first block matches nothing; a gap stops the run.
    assert!(ix.overlaps(&seqs(&[9, 2, 3])).is_empty());
    assert_eq!(ix.block_count(), 5);
    assert_eq!(ix.pair_count(), 4 + 3 + 5);
}

#[test]
fn refcounts_engine_hashes_and_clear() {
    let mut ix = PrefixIndex::default();
    let r = wr(7, 0);
    let s = seqs(&[10, 11]);
    let eng = [EngineBlockHash(0xE0), EngineBlockHash(0xE1)];
    let blocks = || {
        eng.iter()
            .copied()
            .zip([LocalBlockHash(10), LocalBlockHash(11)])
    };
    assert_eq!(ix.store(r, Tier::Device, None, blocks()), Ok(2));
    assert_eq!(
        ix.store(r, Tier::Device, None, blocks()),
        Ok(2),
        "duplicate"
    );
    // A child stored under the engine's parent hash chains from our hash of that parent.
    assert_eq!(
        ix.store(
            r,
            Tier::Device,
            Some(EngineBlockHash(0xE1)),
            [(EngineBlockHash(0xE2), LocalBlockHash(12))]
        ),
        Ok(1)
    );
    assert_eq!(ix.overlaps(&seqs(&[10, 11, 12]))[0].overlap.device, 3);
    // Unknown parent: refused, counted, nothing stored.
    assert_eq!(
        ix.store(
            r,
            Tier::Device,
            Some(EngineBlockHash(0xBAD)),
            [(EngineBlockHash(0xE9), LocalBlockHash(1))]
        ),
        Err(IndexError::UnknownParent {
            rank: r,
            parent: EngineBlockHash(0xBAD)
        })
    );
    assert_eq!(ix.stats().unknown_parents, 1);
    // One removal of a doubly stored block keeps it.
    assert_eq!(ix.remove(r, Tier::Device, [EngineBlockHash(0xE0)]), 0);
    assert_eq!(ix.overlaps(&s)[0].overlap.device, 2);
    assert_eq!(ix.remove(r, Tier::Device, [EngineBlockHash(0xE0)]), 1);
    assert!(ix.overlaps(&s).is_empty());
    assert_eq!(ix.remove(r, Tier::Device, [EngineBlockHash(0xE0)]), 0);
    assert_eq!(ix.stats().unknown_removals, 1);
    ix.clear_rank(r);
    assert_eq!(ix.pair_count(), 0);
    assert_eq!(ix.block_count(), 0);
    assert_eq!(ix.ranks().count(), 1, "cleared ranks stay registered");
}

#[test]
fn a_full_rank_drops_its_oldest_pairs() {
    let mut ix = PrefixIndex::new(3);
    let r = wr(1, 0);
    let locals = [1, 2, 3, 4, 5];
    let s = seqs(&locals);
    let res = ix.store(
        r,
        Tier::Device,
        None,
        s.iter()
            .zip(locals)
            .map(|(s, l)| (EngineBlockHash(s.0), LocalBlockHash(l))),
    );
    assert_eq!(res, Ok(5));
    assert_eq!(ix.rank_blocks(r), 3);
    assert_eq!(ix.stats().evicted, 2);
    let mut newest = s[2..].to_vec();
    newest.sort_unstable_by_key(|h| h.0);
    assert_eq!(ix.rank_sequences(r), newest, "the two oldest went");
    // Other ranks are not affected.
    assert_eq!(store_chain(&mut ix, wr(2, 0), Tier::Device, &[1, 2, 3]), 3);
    assert!(ix.memory_bytes() > 0);
}

/// A publisher that only stores (no removals ever) under a limit set from the engine's
/// capacity: the rank's pairs, its engine-hash map and its order list all stay bounded.
#[test]
fn a_publisher_that_never_removes_stays_within_the_engines_capacity() {
    let mut ix = PrefixIndex::new(u64::MAX);
    let r = wr(7, 0);
    assert_eq!(ix.set_rank_limit(r, 100), Ok(0));
    for chain in 0..2_000u64 {
        let locals: Vec<u64> = (0..8).map(|i| chain * 1000 + i).collect();
        let s = seqs(&locals);
        // Engine hashes unlike ours, as vLLM's are.
        let blocks = s
            .iter()
            .zip(&locals)
            .map(|(s, &l)| (EngineBlockHash(s.0 ^ 0xABCD), LocalBlockHash(l)));
        assert_eq!(ix.store(r, Tier::Device, None, blocks), Ok(8));
        assert!(ix.rank_blocks(r) <= 100);
    }
    assert_eq!(ix.rank_blocks(r), 100);
    assert_eq!(ix.stats().evicted, 16_000 - 100);
    let slot = ix.slot(ix.slot_of(r).unwrap());
    assert_eq!(
        slot.engine.len(),
        100,
        "engine hashes of dropped pairs forgotten"
    );
    assert!(slot.order.len() <= 2 * 100 + super::bound::SLACK);
    // The newest chain is whole; a lower limit drops down to it at once.
    assert_eq!(ix.set_rank_limit(r, 10), Ok(90));
    assert_eq!(ix.rank_blocks(r), 10);
}

#[test]
fn remove_worker_frees_its_slots() {
    let mut ix = PrefixIndex::default();
    for w in 0..4 {
        store_chain(&mut ix, wr(w, 0), Tier::Device, &[1, 2, 3]);
        store_chain(&mut ix, wr(w, 1), Tier::Device, &[1, 2]);
    }
    ix.remove_worker(2);
    assert_eq!(ix.pair_count(), 3 * 5);
    assert!(ix
        .overlaps(&seqs(&[1, 2, 3]))
        .iter()
        .all(|o| o.rank.worker != 2));
    store_chain(&mut ix, wr(9, 0), Tier::Device, &[1]);
    assert_eq!(ix.ranks().count(), 7, "slot reused");
}

/// The slot epoch moves with every slot given or freed, and with nothing else: what lets a
/// pick's slot map trust its entries while it stays.
#[test]
fn the_slot_epoch_moves_with_every_slot_given_or_freed() {
    let mut ix = PrefixIndex::default();
    let workers = |ix: &PrefixIndex| ix.slot_workers().collect::<Vec<_>>();
    let e0 = ix.slot_epoch();
    store_chain(&mut ix, wr(1, 0), Tier::Device, &[1, 2]);
    store_chain(&mut ix, wr(2, 0), Tier::Device, &[1]);
    assert_eq!(ix.slot_epoch(), e0 + 2, "two slots given");
    let (e1, before) = (ix.slot_epoch(), workers(&ix));
    store_chain(&mut ix, wr(1, 0), Tier::Device, &[1, 2, 3]);
    ix.clear_rank(wr(2, 0));
    assert_eq!(
        ix.slot_epoch(),
        e1,
        "blocks stored and cleared: no slot changed"
    );
    assert_eq!(workers(&ix), before);
    ix.remove_worker(1);
    assert_eq!(ix.slot_epoch(), e1 + 1, "a slot freed");
    store_chain(&mut ix, wr(3, 0), Tier::Device, &[1]);
    assert_eq!(ix.slot_epoch(), e1 + 2, "the freed slot given again");
    assert_eq!(ix.slot_worker(0), Some(3), "to worker 3");
}

// ------------------------------------------------------------------------ differential test

struct Gen {
    rng: fastrand::Rng,
}

impl Gen {
    fn path(&mut self, max: usize) -> Vec<u64> {
        let n = self.rng.usize(1..=max);
        (0..n).map(|_| self.rng.u64(0..4)).collect()
    }
    fn tier(&mut self) -> Tier {
        match self.rng.u8(0..10) {
            0..=5 => Tier::Device,
            6..=8 => Tier::Host,
            _ => Tier::Disk,
        }
    }
    fn rank(&mut self) -> WorkerRank {
        wr(self.rng.u64(1..4), self.rng.u32(0..2))
    }
}

/// Worker 1 publishes our hashes; the others their own (salted per rank).
fn engine_of(rank: WorkerRank, seq: SequenceHash) -> EngineBlockHash {
    if rank.worker == 1 {
        EngineBlockHash(seq.0)
    } else {
        EngineBlockHash(seq.0 ^ (0x5A5A_0000 + rank.worker * 16 + u64::from(rank.dp_rank)))
    }
}

fn differential(seed: u64, limit: u64, ops: usize) {
    let mut g = Gen {
        rng: fastrand::Rng::with_seed(seed),
    };
    let mut fast = PrefixIndex::new(limit);
    let mut reference = ReferenceIndex::new(limit);
    let mut scratch = MatchScratch::default();
    let mut out = Vec::new();
    let all_ranks: Vec<WorkerRank> = (1..4).flat_map(|w| (0..2).map(move |d| wr(w, d))).collect();
    for op in 0..ops {
        let ctx = format!("seed {seed} op {op}");
        match g.rng.u8(0..100) {
            0..=49 => {
                let rank = g.rank();
                let tier = g.tier();
                let path = g.path(7);
                let s = seqs(&path);
                let k = g.rng.usize(0..path.len());
                let parent = (k > 0).then(|| engine_of(rank, s[k - 1]));
                let blocks: Vec<(EngineBlockHash, LocalBlockHash)> = (k..path.len())
                    .map(|j| (engine_of(rank, s[j]), LocalBlockHash(path[j])))
                    .collect();
                let a = fast.store(rank, tier, parent, blocks.iter().copied());
                let b = reference.store(rank, tier, parent, blocks.iter().copied());
                assert_eq!(a, b, "{ctx}: store");
            }
            50..=74 => {
                let rank = g.rank();
                let tier = g.tier();
                let s = seqs(&g.path(7));
                let mut hashes: Vec<EngineBlockHash> = s
                    .iter()
                    .filter(|_| g.rng.bool())
                    .map(|&h| engine_of(rank, h))
                    .collect();
                if g.rng.u8(0..10) == 0 {
                    hashes.push(EngineBlockHash(g.rng.u64(..)));
                }
                g.rng.shuffle(&mut hashes);
                let a = fast.remove(rank, tier, hashes.iter().copied());
                let b = reference.remove(rank, tier, hashes.iter().copied());
                assert_eq!(a, b, "{ctx}: remove");
            }
            75..=76 => {
                let rank = g.rank();
                fast.clear_rank(rank);
                reference.clear_rank(rank);
            }
            77 => {
                let w = g.rng.u64(1..4);
                fast.remove_worker(w);
                reference.remove_worker(w);
            }
            78..=79 if limit != u64::MAX => {
                // The engine reports its capacity: the rank's own limit, oldest pairs dropped.
                let rank = g.rank();
                let l = g.rng.u64(1..=limit);
                let a = fast.set_rank_limit(rank, l);
                let b = reference.set_rank_limit(rank, l);
                assert_eq!(a, Ok(b), "{ctx}: set_rank_limit");
            }
            _ => {
                let q = seqs(&g.path(9));
                fast.find_matches(&q, &mut scratch, &mut out);
                assert_eq!(
                    sorted(out.clone()),
                    reference.overlaps(&q),
                    "{ctx}: find_matches"
                );
                for o in &out {
                    let ov = o.overlap;
                    assert!(ov.device <= ov.host && ov.host <= ov.disk && ov.disk > 0);
                }
                let exact = sorted(out.clone());
                assert_levels_agree(&fast, &q, false, &exact, &all_ranks, &ctx);
            }
        }
        if op % 50 == 0 {
            assert_eq!(fast.pair_count(), reference.pair_count(), "{ctx}: pairs");
            for &r in &all_ranks {
                assert_eq!(
                    fast.rank_blocks(r),
                    reference.rank_blocks(r),
                    "{ctx}: {r:?}"
                );
            }
        }
    }
}

#[test]
fn agrees_with_reference_on_random_event_streams() {
    for seed in 0..40 {
        differential(seed, u64::MAX, 3000);
    }
}

#[test]
fn agrees_with_reference_under_capacity_pressure() {
    for seed in 100..120 {
        differential(seed, 12, 3000);
    }
}

#[test]
fn rank_sequences_lists_each_ranks_blocks() {
    let mut ix = PrefixIndex::default();
    let (a, b) = (wr(1, 0), wr(2, 0));
    store_chain(&mut ix, a, Tier::Device, &[1, 2, 3]);
    store_chain(&mut ix, b, Tier::Host, &[1, 2]);
    let mut want = seqs(&[1, 2, 3]);
    want.sort_unstable_by_key(|h| h.0);
    assert_eq!(ix.rank_sequences(a), want);
    let mut want = seqs(&[1, 2]);
    want.sort_unstable_by_key(|h| h.0);
    assert_eq!(ix.rank_sequences(b), want);
    assert!(ix.rank_sequences(wr(3, 0)).is_empty());
}

/// A dump restored into a fresh index (another table seed) gives an equal index: same pairs, same
/// answers, and later removals by engine hash behave the same.
#[test]
fn dump_and_restore_rebuild_an_equal_index() {
    let mut rng = fastrand::Rng::with_seed(9);
    let mut a = PrefixIndex::new(1 << 20);
    let ranks: Vec<WorkerRank> = (0..6)
        .map(|i| WorkerRank {
            worker: i / 2,
            dp_rank: (i % 2) as u32,
        })
        .collect();
    let mut chains: Vec<Vec<(EngineBlockHash, LocalBlockHash)>> = Vec::new();
    for c in 0..40u64 {
        let n = rng.usize(1..20);
        chains.push(
            (0..n as u64)
                .map(|i| {
                    let local = LocalBlockHash(c * 1000 + i);
                    // Half the engines publish hashes of their own.
                    let engine = if c % 2 == 0 { c * 7_000_000 + i } else { 0 };
                    (EngineBlockHash(engine), local)
                })
                .collect(),
        );
    }
    for step in 0..400 {
        let rank = ranks[rng.usize(..ranks.len())];
        let chain = &chains[rng.usize(..chains.len())];
        let tier = Tier::ALL[rng.usize(..3)];
        // Blocks whose engine hash is ours: fill in our sequence hash as the engine hash.
        let seqs = crate::hash::sequence_hashes(&chain.iter().map(|(_, l)| *l).collect::<Vec<_>>());
        let blocks: Vec<(EngineBlockHash, LocalBlockHash)> = chain
            .iter()
            .zip(&seqs)
            .map(|((e, l), s)| (if e.0 == 0 { EngineBlockHash(s.0) } else { *e }, *l))
            .collect();
        if step % 5 == 4 {
            let k = rng.usize(..blocks.len());
            a.remove(rank, tier, blocks[k..].iter().map(|(e, _)| *e));
        } else {
            let _ = a.store(rank, tier, None, blocks);
        }
    }
    let dump = a.dump();
    let mut b = PrefixIndex::with_seed(1 << 20, 12345);
    let restored = b.restore(&dump).unwrap();
    assert_eq!(restored, a.pair_count());
    assert_eq!(b.pair_count(), a.pair_count());
    assert_eq!(
        b.dump(),
        dump,
        "a dump of the restored index is the same dump"
    );
    let sorted = |mut v: Vec<RankOverlap>| {
        v.sort_by_key(|o| o.rank);
        v
    };
    for chain in &chains {
        let seqs = crate::hash::sequence_hashes(&chain.iter().map(|(_, l)| *l).collect::<Vec<_>>());
        assert_eq!(sorted(a.overlaps(&seqs)), sorted(b.overlaps(&seqs)));
    }
    // Removing by engine hash after the restore: the same effect on both.
    for chain in chains.iter().step_by(2) {
        for rank in &ranks {
            let es: Vec<EngineBlockHash> = chain.iter().map(|(e, _)| *e).collect();
            assert_eq!(
                a.remove(*rank, Tier::Device, es.clone()),
                b.remove(*rank, Tier::Device, es)
            );
        }
    }
    assert_eq!(b.dump(), a.dump());
}

/// Many ranks holding prefixes of one prompt, of a few shared lengths and in several tiers, some
/// with a block removed in the middle: the walk that counts runs of equal holders once must
/// report exactly what the reference reports.
#[test]
fn shared_prefixes_with_many_holders_agree_with_reference() {
    let prompt: Vec<u64> = (0..300).collect();
    let query = seqs(&prompt);
    let mut rng = fastrand::Rng::with_seed(11);
    for round in 0..20 {
        let mut fast = PrefixIndex::new(u64::MAX);
        let mut reference = ReferenceIndex::new(u64::MAX);
        let lengths = [1, 7, 64, 65, 200, 300];
        for w in 0..150u64 {
            let rank = wr(w, (w % 2) as u32);
            let len = lengths[rng.usize(..lengths.len())];
            let tier = [Tier::Device, Tier::Host, Tier::Disk][rng.usize(..3)];
            let s = &query[..len];
            let blocks = || {
                s.iter()
                    .zip(&prompt[..len])
                    .map(|(h, &l)| (EngineBlockHash(h.0), LocalBlockHash(l)))
            };
            fast.store(rank, tier, None, blocks()).unwrap();
            reference.store(rank, tier, None, blocks()).unwrap();
            if rng.u8(..4) == 0 {
                // A second tier for some, and a gap for others.
                let t2 = Tier::Device;
                fast.store(rank, t2, None, blocks()).unwrap();
                reference.store(rank, t2, None, blocks()).unwrap();
            }
            if len > 2 && rng.u8(..5) == 0 {
                let gap = [EngineBlockHash(s[rng.usize(1..len)].0)];
                fast.remove(rank, tier, gap);
                reference.remove(rank, tier, gap);
            }
        }
        for cut in [1, 5, 64, 65, 130, 300] {
            let q = &query[..cut];
            assert_eq!(
                sorted(fast.overlaps(q)),
                sorted(reference.overlaps(q)),
                "round {round}, query of {cut} blocks"
            );
        }
    }
}

/// A walk into levels ([`PrefixIndex::walk_levels`]) reads the same runs as the walk that
/// writes them (`want`, sorted), all at once and rank by rank (`ranks`, some holding nothing).
fn assert_levels_agree(
    ix: &PrefixIndex,
    q: &[SequenceHash],
    jump: bool,
    want: &[RankOverlap],
    ranks: &[WorkerRank],
    ctx: &str,
) {
    let mut scratch = MatchScratch::default();
    let mut out = Vec::new();
    ix.walk_levels(q, &mut scratch, jump);
    ix.walked_all(&scratch, &mut out);
    assert_eq!(sorted(out), want, "{ctx}: levels, all ranks");
    let hint = std::sync::atomic::AtomicU32::new(0);
    for &r in ranks {
        let got = ix.walked(&scratch, r, &hint);
        let expected = want.iter().find(|o| o.rank == r).map(|o| o.overlap);
        assert_eq!(got, expected, "{ctx}: levels, {r:?}");
    }
    // Each level ends where its holders' runs through it may end, and the first holds them all.
    let levels: Vec<_> = (0..ix.level_count(&scratch))
        .map(|k| ix.level(&scratch, k).unwrap())
        .collect();
    for o in want {
        let first = levels.first().unwrap();
        assert!(
            (0..first.len()).any(|j| first.rank(j) == Some(o.rank)),
            "{ctx}"
        );
        assert!(
            levels
                .iter()
                .any(|l| l.end() >= o.overlap.disk
                    && (0..l.len()).any(|j| l.rank(j) == Some(o.rank))),
            "{ctx}"
        );
    }
    // Written out, the levels give the same runs again (and stay readable).
    let count = levels.len();
    ix.materialize(&mut scratch);
    assert_eq!(ix.level_count(&scratch), count, "{ctx}: levels kept");
    let mut out = Vec::new();
    ix.walked_all(&scratch, &mut out);
    assert_eq!(sorted(out), want, "{ctx}: materialized, all ranks");
    for &r in ranks {
        let expected = want.iter().find(|o| o.rank == r).map(|o| o.overlap);
        assert_eq!(
            ix.walked(&scratch, r, &hint),
            expected,
            "{ctx}: materialized, {r:?}"
        );
    }
}

/// The jumping walk against the exact one (and the reference) on prefix-closed contents: many
/// ranks hold, per tier class, a prefix of one of a few long prompts that share a system prompt
/// (device ⊆ device-or-host ⊆ any), some trimmed from the tail afterwards as an engine evicts,
/// some storing blocks twice.
#[test]
fn jumping_walk_equals_the_exact_walk_on_prefix_closed_indexes() {
    let system: Vec<u64> = (0..150).collect();
    let families: Vec<Vec<u64>> = (0..4u64)
        .map(|f| {
            let mut p = system.clone();
            p.extend((0..450).map(|i| 1_000 * (f + 1) + i));
            p
        })
        .collect();
    let hashes: Vec<Vec<SequenceHash>> = families.iter().map(|p| seqs(p)).collect();
    let mut rng = fastrand::Rng::with_seed(23);
    let mut jumped = 0;
    for round in 0..30 {
        let mut ix = PrefixIndex::new(u64::MAX);
        let mut reference = ReferenceIndex::new(u64::MAX);
        // Few distinct lengths, so many ranks share holder sets (long alike stretches).
        let lengths = [0usize, 1, 100, 150, 151, 300, 599, 600];
        for w in 0..60u64 {
            let rank = wr(w, (w % 3) as u32);
            for _ in 0..rng.usize(1..=2) {
                let f = rng.usize(..families.len());
                let mut cut = [0usize; 3];
                for c in &mut cut {
                    *c = lengths[rng.usize(..lengths.len())];
                }
                cut.sort_unstable();
                let (d, h, a) = (cut[0], cut[1], cut[2]);
                for (tier, range) in [(Tier::Device, 0..d), (Tier::Host, d..h), (Tier::Disk, h..a)]
                {
                    let blocks: Vec<(EngineBlockHash, LocalBlockHash)> = range
                        .clone()
                        .map(|i| {
                            (
                                EngineBlockHash(hashes[f][i].0),
                                LocalBlockHash(families[f][i]),
                            )
                        })
                        .collect();
                    let parent = range
                        .start
                        .checked_sub(1)
                        .map(|i| EngineBlockHash(hashes[f][i].0));
                    let copies = if rng.u8(..5) == 0 { 2 } else { 1 };
                    for _ in 0..copies {
                        let x = ix.store(rank, tier, parent, blocks.iter().copied());
                        let y = reference.store(rank, tier, parent, blocks.iter().copied());
                        assert_eq!(x, y);
                    }
                }
                if d > 1 && rng.u8(..3) == 0 {
                    // Evicted from the device tail first, as an engine does.
                    let keep = rng.usize(1..d);
                    let tail: Vec<EngineBlockHash> = hashes[f][keep..d]
                        .iter()
                        .rev()
                        .map(|s| EngineBlockHash(s.0))
                        .collect();
                    ix.remove(rank, Tier::Device, tail.iter().copied());
                    reference.remove(rank, Tier::Device, tail.iter().copied());
                }
            }
        }
        let mut scratch = MatchScratch::default();
        let (mut exact, mut jumping) = (Vec::new(), Vec::new());
        for q in &hashes {
            for cut in [JUMP_MIN_BLOCKS, 149, 150, 151, 152, 301, 599, 600] {
                let q = &q[..cut];
                ix.find_matches(q, &mut scratch, &mut exact);
                ix.find_matches_jumping(q, &mut scratch, &mut jumping);
                let exact = sorted(exact.clone());
                assert_eq!(
                    exact,
                    sorted(reference.overlaps(q)),
                    "round {round}, {cut} blocks"
                );
                assert_eq!(
                    sorted(jumping.clone()),
                    exact,
                    "round {round}, {cut} blocks"
                );
                let ranks: Vec<WorkerRank> = (0..60u64).map(|w| wr(w, (w % 3) as u32)).collect();
                let ctx = format!("round {round}, {cut} blocks");
                assert_levels_agree(&ix, q, true, &exact, &ranks, &ctx);
                jumped += usize::from(exact.iter().any(|o| o.overlap.disk > 100));
            }
        }
    }
    assert!(jumped > 100, "queries with long matches: {jumped}");
}

/// The jumping walk reads far fewer blocks than the prefix it matches: a 4,000-block prompt held
/// whole by one rank and in part by others is found with a few hundred probes at most (counted
/// through a table that records them).
#[test]
fn jumping_walk_finds_long_prefixes_with_few_probes() {
    let prompt: Vec<u64> = (0..4000).collect();
    let q = seqs(&prompt);
    let mut ix = PrefixIndex::new(u64::MAX);
    store_chain(&mut ix, wr(1, 0), Tier::Device, &prompt);
    store_chain(&mut ix, wr(2, 0), Tier::Device, &prompt[..1000]);
    store_chain(&mut ix, wr(3, 0), Tier::Host, &prompt[..2500]);
    let mut scratch = MatchScratch::default();
    let mut out = Vec::new();
    let before = table::probes();
    ix.find_matches_jumping(&q, &mut scratch, &mut out);
    let probes = table::probes() - before;
    assert_eq!(
        sorted(out),
        vec![
            RankOverlap {
                rank: wr(1, 0),
                overlap: od(4000, 4000, 4000)
            },
            RankOverlap {
                rank: wr(2, 0),
                overlap: od(1000, 1000, 1000)
            },
            RankOverlap {
                rank: wr(3, 0),
                overlap: od(0, 2500, 2500)
            },
        ]
    );
    assert!(probes < 200, "{probes} probes for 4,000 matched blocks");
    let before = table::probes();
    ix.find_matches(&q, &mut scratch, &mut Vec::new());
    assert_eq!(
        table::probes() - before,
        4000,
        "the exact walk reads every block"
    );
}

/// A rank that lost a prompt's first blocks but kept later ones (an engine's oldest pairs
/// dropped at capacity) is not followed: a walk into levels stops where no run is alive, as
/// the walk that writes runs does, in both kinds of walk.
#[test]
fn a_walk_into_levels_stops_where_no_run_is_alive() {
    let mut ix = PrefixIndex::new(u64::MAX);
    let prompt: Vec<u64> = (1..=400).collect();
    let (a, b) = (wr(1, 0), wr(2, 0));
    store_chain(&mut ix, a, Tier::Device, &prompt[..10]);
    store_chain(&mut ix, b, Tier::Device, &prompt);
    // B's first five blocks go, as if dropped oldest first.
    let first: Vec<EngineBlockHash> = seqs(&prompt)[..5]
        .iter()
        .map(|s| EngineBlockHash(s.0))
        .collect();
    ix.remove(b, Tier::Device, first.iter().copied());
    let q = seqs(&prompt);
    for jump in [false, true] {
        let mut scratch = MatchScratch::default();
        ix.walk_levels(&q, &mut scratch, jump);
        let levels: Vec<_> = (0..ix.level_count(&scratch))
            .map(|k| ix.level(&scratch, k).unwrap())
            .collect();
        assert_eq!(levels.len(), 2, "jump {jump}: A alone, then A with B");
        assert_eq!(levels[1].end(), 10, "jump {jump}: nothing past A's run");
        let mut out = Vec::new();
        ix.walked_all(&scratch, &mut out);
        assert_eq!(out.len(), 1, "jump {jump}: only A holds the prompt's start");
        assert_eq!(out[0].overlap.disk, 10);
    }
}

mod shared;

/// A table past two huge pages (4 MiB: 262,144 slots of 16 bytes) is advised onto huge pages as
/// it grows, so the index's one system call runs here, and the table keeps every key through it.
#[test]
fn a_table_advised_onto_huge_pages_keeps_every_key() {
    let mut t = table::BlockTable::new(KeyedBuild::with_key(7));
    let n: u64 = 200_000;
    for k in 1..=n {
        let (v, fresh) = t.get_or_insert(k * 0x9E37_79B9, k);
        assert!(fresh && *v == k, "key {k}");
    }
    assert!(t.bytes() >= 4 << 20, "{} bytes", t.bytes());
    assert_eq!(t.len(), n as usize);
    assert!((1..=n).all(|k| t.get(k * 0x9E37_79B9) == Some(k)));
}
