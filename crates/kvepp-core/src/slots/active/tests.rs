//! Tests of the active-request trie: splits and merges, plans made stale by writes, and a
//! differential test against counting distinct prefixes of the live requests.
use super::*;

fn seq(xs: &[u64]) -> Arc<[SequenceHash]> {
    xs.iter().map(|&x| SequenceHash(x)).collect()
}

/// The rank's active share of `xs`, by both walks (which must agree).
fn held(t: &ActiveTrie, xs: &[u64], rank: usize) -> u64 {
    let mut s = HeldScratch::default();
    t.walk(&seq(xs), &mut s, 256);
    let (got, most) = (s.get(rank), s.most());
    let holders: std::collections::BTreeSet<u32> =
        (0..s.holder_count()).filter_map(|k| s.holder(k)).collect();
    t.walk_path(&seq(xs), &mut s, usize::MAX);
    assert_eq!(s.get(rank), got, "walk_path, rank {rank}");
    assert_eq!(s.most(), most, "walk_path: the most held");
    let listed: std::collections::BTreeSet<u32> =
        (0..s.holder_count()).filter_map(|k| s.holder(k)).collect();
    assert_eq!(listed, holders, "walk_path: the holders");
    // Each node's listed ranks read from that node down: what the whole path gives.
    for k in 0..s.path_len() {
        let node = s.path_node(k).expect("a node of the path");
        for j in node.ranks {
            let r = s.holder(j).expect("a listed rank") as usize;
            assert_eq!(s.get_listed(r, k), s.get(r), "rank {r} listed in node {k}");
        }
    }
    // Wide nodes (every one with a bit set) copied as bit sets: the same shares.
    t.walk_path(&seq(xs), &mut s, 0);
    assert_eq!(s.get(rank), got, "walk_path with bit sets, rank {rank}");
    assert_eq!(s.most(), most, "walk_path with bit sets: the most held");
    got
}

#[test]
fn splits_and_merges_keep_counts_and_paths_short() {
    let mut t = ActiveTrie::with_seed(1);
    let (a, new_a) = t.insert(0, &seq(&[1, 2, 3, 4]));
    assert_eq!(new_a, 4);
    let (b, new_b) = t.insert(0, &seq(&[1, 2, 5]));
    assert_eq!(new_b, 1, "only the block after the shared prefix is new");
    let (c, new_c) = t.insert(1, &seq(&[1, 2]));
    assert_eq!(new_c, 2, "new to rank 1");
    assert_eq!(held(&t, &[1, 2, 3, 9], 0), 3);
    assert_eq!(held(&t, &[1, 2, 3, 9], 1), 2);
    assert_eq!(held(&t, &[7], 0), 0);
    // root, [1,2], [3,4], [5]
    assert_eq!(t.node_count(), 4);
    assert_eq!(t.remove(0, b), 1);
    assert_eq!(t.remove(1, c), 2);
    // [1,2] now has one child and no end: merged back into one node.
    assert_eq!(t.node_count(), 2);
    assert_eq!(held(&t, &[1, 2, 3, 4, 5], 0), 4);
    assert_eq!(t.remove(0, a), 4);
    assert_eq!(t.node_count(), 1, "only the root is left");
    assert!(t.edges.is_empty());
}

/// A path through more nodes than a plan names is inserted the plain way, and is not
/// counted as a stale plan.
#[test]
fn a_path_too_long_to_plan_is_inserted_anew() {
    let mut t = ActiveTrie::with_seed(2);
    let xs: Vec<u64> = (1..=40).collect();
    // A request ending at every other block: a node per two blocks along the path.
    for k in (2..=xs.len()).step_by(2) {
        t.insert(1, &seq(&xs[..k]));
    }
    let long = seq(&[&xs[..], &[99]].concat());
    let plan = t.plan(&long);
    assert!(!plan.whole, "{} nodes fit a plan", PLAN_STEPS);
    let (end, added) = t.insert_planned(0, &long, &plan);
    assert_eq!(added, 41, "every block is new to rank 0");
    assert_eq!(t.stale_plans(), 0);
    assert_eq!(held(&t, &[&xs[..], &[99]].concat(), 0), 41);
    assert_eq!(t.remove(0, end), 41);
    // A short one is planned whole and inserted along its plan.
    let short = seq(&xs[..4]);
    let plan = t.plan(&short);
    assert!(plan.whole);
    assert_eq!(t.insert_planned(0, &short, &plan).1, 4);
    assert_eq!(t.stale_plans(), 0);
}

/// Differential: random chained and unchained lists over a few ranks against counting
/// distinct prefixes per rank from the list of active requests.
/// Every node's bit set is empty or names exactly its ranks.
fn check_bits(t: &ActiveTrie) {
    for (n, node) in t.nodes.iter().enumerate() {
        if node.bits.is_empty() {
            continue;
        }
        let set: Vec<u32> = (0..node.bits.len() as u32 * 64)
            .filter(|&r| node.bits[r as usize / 64] >> (r % 64) & 1 == 1)
            .collect();
        assert_eq!(set, node.ids, "node {n}: the bit set names its ranks");
    }
}

/// The dense ids of the differential test's three ranks: far apart, so their bits fall in
/// different words.
const IDS: [u32; 3] = [0, 67, 130];

#[test]
fn agrees_with_distinct_prefixes_of_the_active_requests() {
    let mut rng = fastrand::Rng::with_seed(7);
    let mut t = ActiveTrie::with_seed(3);
    let mut live: Vec<(u32, Vec<u64>, u32)> = Vec::new();
    let mut blocks = [0u64; 3];
    // Insertions planned at one step and made at a later one, as a booking plans under the
    // read lock and inserts under the write lock, with other writes in between.
    type Planned = (u32, Arc<[SequenceHash]>, InsertPlan, Vec<u64>);
    let mut planned: Vec<Planned> = Vec::new();
    let mut applied = 0;
    for step in 0..4_000 {
        if live.len() < 40 && rng.bool() {
            let rank = rng.u32(..3);
            let stem = rng.u64(..3);
            let xs: Vec<u64> = (0..rng.usize(..12))
                .map(|i| {
                    if i < 6 {
                        stem * 10 + i as u64
                    } else {
                        rng.u64(..4) + 100
                    }
                })
                .collect();
            let s = seq(&xs);
            if rng.bool() {
                planned.push((rank, Arc::clone(&s), t.plan(&s), xs));
            } else {
                let (end, added) = t.insert(IDS[rank as usize], &s);
                blocks[rank as usize] += added;
                live.push((rank, xs, end));
            }
        } else if !planned.is_empty() && rng.bool() {
            let (rank, s, plan, xs) = planned.swap_remove(rng.usize(..planned.len()));
            let (end, added) = t.insert_planned(IDS[rank as usize], &s, &plan);
            applied += 1;
            blocks[rank as usize] += added;
            live.push((rank, xs, end));
        } else if !live.is_empty() {
            let (rank, _, end) = live.swap_remove(rng.usize(..live.len()));
            blocks[rank as usize] -= t.remove(IDS[rank as usize], end);
        }
        check_bits(&t);
        for rank in 0..3u32 {
            let mine: Vec<&Vec<u64>> = live.iter().filter(|l| l.0 == rank).map(|l| &l.1).collect();
            let prefixes: std::collections::HashSet<&[u64]> = mine
                .iter()
                .flat_map(|xs| (1..=xs.len()).map(|n| &xs[..n]))
                .collect();
            assert_eq!(blocks[rank as usize], prefixes.len() as u64, "step {step}");
            let probe: Vec<u64> = (0..rng.usize(..12))
                .map(|i| {
                    if i < 6 {
                        rng.u64(..3) * 10 + i as u64
                    } else {
                        rng.u64(..4) + 100
                    }
                })
                .collect();
            let want = mine
                .iter()
                .map(|xs| xs.iter().zip(&probe).take_while(|(a, b)| a == b).count())
                .max()
                .unwrap_or(0) as u64;
            let id = IDS[rank as usize] as usize;
            assert_eq!(held(&t, &probe, id), want, "step {step}");
        }
        assert!(t.node_count() <= 2 * live.len() + 1, "step {step}");
    }
    while let Some((rank, _, end)) = live.pop() {
        blocks[rank as usize] -= t.remove(IDS[rank as usize], end);
    }
    assert_eq!(blocks, [0; 3]);
    assert_eq!(t.node_count(), 1);
    // Both kinds of planned insertion ran: along a plan that held, and anew after a stale one.
    assert!(t.stale_plans() > 0, "no plan went stale");
    assert!(t.stale_plans() < applied, "every plan went stale");
}
