//! The cost's choices against plain definitions.

use super::*;

fn load(
    device: u64,
    host: u64,
    disk: u64,
    prefill: u64,
    decode: u64,
    active: u32,
) -> CandidateLoad {
    CandidateLoad {
        overlap: Overlap { device, host, disk },
        potential_prefill_tokens: prefill,
        potential_decode_blocks: decode,
        active_requests: active,
    }
}

#[test]
fn formula_by_hand() {
    let w = CostWeights::dynamo();
    // 512 prompt tokens + 64 active prefill, block 16: 36 blocks; 10 on GPU, 4 more on host, 2 more on disk.
    let c = load(10, 14, 16, 576, 40, 3);
    let credit = 10.0 + 0.75 * 4.0 + 0.25 * 2.0;
    assert_eq!(w.overlap_credit(c.overlap), credit);
    assert_eq!(w.cost(16, &c), (36.0 - credit) + 40.0);
    let w2 = CostWeights {
        prefill_load_scale: 2.0,
        decode_active_request_weight: 1.5,
        ..w
    };
    assert_eq!(w2.cost(16, &c), 2.0 * (36.0 - credit) + 40.0 + 4.5);
    // More credit than prefill: clamped at zero, only decode load remains.
    assert_eq!(w.cost(16, &load(100, 100, 100, 32, 7, 0)), 7.0);
    // effective = isl - round(credit * block_size)
    assert_eq!(
        w.effective_prefill_tokens(512, 16, c.overlap),
        512 - (credit * 16.0) as u64
    );
    assert_eq!(
        w.effective_prefill_tokens(
            100,
            16,
            Overlap {
                device: 50,
                host: 50,
                disk: 50
            }
        ),
        0
    );
}

#[test]
fn choose_cheapest_with_random_ties() {
    let w = CostWeights::dynamo();
    let mut rng = fastrand::Rng::with_seed(3);
    let mut seen = [0; 4];
    for _ in 0..4000 {
        seen[w.choose(&[5.0, 2.0, 2.0, 9.0], || rng.f64())] += 1;
    }
    assert_eq!((seen[0], seen[3]), (0, 0));
    assert!(seen[1] > 1700 && seen[2] > 1700, "{seen:?}");
}

#[test]
fn temperature_samples_a_softmax() {
    let w = CostWeights {
        temperature: 0.5,
        ..CostWeights::dynamo()
    };
    let mut rng = fastrand::Rng::with_seed(11);
    let mut seen = [0u32; 3];
    let n = 30_000;
    for _ in 0..n {
        seen[w.choose(&[0.0, 5.0, 10.0], || rng.f64())] += 1;
    }
    // Normalised costs 0, 0.5, 1 → weights 1, e^-1, e^-2.
    let z = 1.0 + (-1.0f64).exp() + (-2.0f64).exp();
    for (i, want) in [1.0 / z, (-1.0f64).exp() / z, (-2.0f64).exp() / z]
        .iter()
        .enumerate()
    {
        let got = f64::from(seen[i]) / f64::from(n);
        assert!((got - want).abs() < 0.02, "candidate {i}: {got} vs {want}");
    }
    // Equal costs: uniform, whatever the temperature.
    let mut rng = fastrand::Rng::with_seed(5);
    let mut eq = [0; 2];
    for _ in 0..2000 {
        eq[w.choose(&[4.0, 4.0], || rng.f64())] += 1;
    }
    assert!(eq[0] > 800 && eq[1] > 800, "{eq:?}");
}

/// The plain definition of [`CostWeights::choose_two`]: the cheapest, the least tie-break key
/// among them, a uniform draw among those; a `min_by` over the others for the runner-up.
fn reference_two(
    w: &CostWeights,
    costs: &[f64],
    tiebreak: impl Fn(usize) -> u32,
    booked_at: impl Fn(usize) -> i64,
    rng: &mut fastrand::Rng,
) -> (usize, Option<usize>) {
    let best = if w.temperature > 0.0 {
        w.choose(costs, || rng.f64())
    } else {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let key = |i: usize| (tiebreak(i), booked_at(i));
        let least = (0..costs.len())
            .filter(|&i| costs[i] <= min)
            .map(key)
            .min()
            .unwrap_or((0, 0));
        let tied = |i: &usize| costs[*i] <= min && key(*i) == least;
        let n = (0..costs.len()).filter(tied).count();
        (0..costs.len())
            .filter(tied)
            .nth(rng.usize(..n.max(1)))
            .unwrap_or(0)
    };
    (best, runner_up(costs, best, &tiebreak))
}

#[test]
fn choose_two_agrees_with_the_simple_choice() {
    // Not a caller's case (candidates are never empty), but no panic either.
    let w = CostWeights::dynamo();
    assert_eq!(
        w.choose_two(&[], |_| 0, |_| 0, &mut fastrand::Rng::with_seed(1)),
        (0, None)
    );
    let mut gen = fastrand::Rng::with_seed(17);
    let odd = [f64::NAN, f64::INFINITY, -0.0, 0.0, -1.0, f64::NEG_INFINITY];
    for round in 0..20_000 {
        let n = gen.usize(1..12);
        let costs: Vec<f64> = (0..n)
            .map(|_| match gen.u8(..10) {
                0 => odd[gen.usize(..odd.len())],
                _ => f64::from(gen.u8(..4)) * 0.5,
            })
            .collect();
        let ties: Vec<u32> = (0..n).map(|_| gen.u32(..3)).collect();
        let booked: Vec<i64> = (0..n).map(|_| gen.i64(-1..2)).collect();
        let w = CostWeights {
            temperature: if round % 7 == 0 { 0.3 } else { 0.0 },
            ..CostWeights::dynamo()
        };
        let (mut a, mut b) = (
            fastrand::Rng::with_seed(round),
            fastrand::Rng::with_seed(round),
        );
        let got = w.choose_two(&costs, |i| ties[i], |i| booked[i], &mut a);
        let want = reference_two(&w, &costs, |i| ties[i], |i| booked[i], &mut b);
        assert_eq!(
            got, want,
            "costs {costs:?}, ties {ties:?}, booked {booked:?}"
        );
        // Same draws: the pick after this one sees the same random numbers.
        assert_eq!(a.u64(..), b.u64(..));
    }
}

/// Bounded loads against the plain definition: the cheapest candidate among those holding at
/// most `ceil(b·(Σ + 1) / n)` requests with this one, `b` the plain bound or for exempt ones
/// the cached bound (none when 0), on random costs and loads.
#[test]
fn bounded_loads_choose_the_cheapest_within_the_bound() {
    let mut gen = fastrand::Rng::with_seed(5);
    let mut moved = 0;
    for round in 0..20_000 {
        let n = gen.usize(1..10);
        let mut costs: Vec<f64> = (0..n).map(|_| f64::from(gen.u16(..500))).collect();
        let requests: Vec<u32> = (0..n).map(|_| gen.u32(..8)).collect();
        // A prompt of 10 blocks; every candidate holds `floor` of them, some hold more.
        let (blocks, floor) = (10u64, gen.u64(..=3));
        let inputs: Vec<BoundInput> = requests
            .iter()
            .map(|&requests| BoundInput {
                requests,
                cached: floor + gen.u64(..=7),
            })
            .collect();
        let exempt_share = [0.0, 0.25, 0.5, 1.0, 1.5][(round / 15) % 5];
        let bound = [1.0, 1.1, 1.25, 1.5, 3.0][round % 5];
        let cached = [0.0, bound, 1.5 * bound][(round / 5) % 3];
        let w = CostWeights {
            load_bound: bound,
            load_bound_cached: cached,
            load_bound_exempt_cached: exempt_share,
            ..CostWeights::dynamo()
        };
        assert!(w.validate().is_empty());
        let total: u32 = requests.iter().sum();
        let cap = |b: f64| (b * f64::from(total + 1) / n as f64).ceil();
        // Exempt: at least the share of the prompt cached beyond the least any candidate
        // holds (with one candidate there is nothing to bound).
        let least = inputs.iter().map(|b| b.cached).min().unwrap_or(0);
        let exempt = |i: usize| (inputs[i].cached - least) as f64 >= exempt_share * 10.0;
        let within_bound = |i: usize| match (exempt(i), cached) {
            (true, 0.0) => true,
            (true, c) => f64::from(requests[i] + 1) <= cap(c),
            (false, _) => f64::from(requests[i] + 1) <= cap(bound),
        };
        let within: Vec<usize> = (0..n).filter(|&i| within_bound(i)).collect();
        assert!(
            !within.is_empty(),
            "a least-loaded candidate is always within"
        );
        let best_within = within
            .iter()
            .map(|&i| costs[i])
            .fold(f64::INFINITY, f64::min);
        let cheapest = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let original = costs.clone();
        let passed_over = w.bound_loads(&mut costs, &inputs, blocks);
        assert_eq!(
            passed_over,
            cheapest < best_within,
            "{original:?} {requests:?}"
        );
        moved += usize::from(passed_over);
        let mut rng = fastrand::Rng::with_seed(round as u64);
        let chosen = w.choose_with_tiebreak(&costs, |_| 0, |_| 0, &mut rng);
        assert!(
            within.contains(&chosen),
            "{original:?} {requests:?} → {chosen}"
        );
        assert_eq!(original[chosen], best_within);
        // Within the bound nothing changed, and over it the order is kept.
        for i in 0..n {
            if within.contains(&i) {
                assert_eq!(costs[i], original[i]);
            }
            for j in 0..n {
                if original[i] < original[j] && !within.contains(&i) && !within.contains(&j) {
                    assert!(costs[i] < costs[j]);
                }
            }
        }
    }
    assert!(moved > 1000, "the bound moved {moved} choices");
    // Off, or one candidate: untouched.
    let mut costs = vec![1.0, 5.0];
    let inputs = [9, 0].map(|requests| BoundInput {
        requests,
        cached: 0,
    });
    assert!(!CostWeights::dynamo().bound_loads(&mut costs, &inputs, 10));
    assert_eq!(costs, [1.0, 5.0]);
}

#[test]
fn load_bound_is_zero_or_at_least_one() {
    for (bound, ok) in [
        (0.0, true),
        (1.0, true),
        (1.3, true),
        (0.5, false),
        (f64::NAN, false),
        (f64::INFINITY, false),
    ] {
        let w = CostWeights {
            load_bound: bound,
            ..CostWeights::dynamo()
        };
        assert_eq!(w.validate().is_empty(), ok, "{bound}");
    }
    // The cached bound: 0 (none) or at least 1 and at least the plain bound.
    for (bound, cached, ok) in [
        (1.0, 0.0, true),
        (1.0, 1.0, true),
        (1.25, 1.5, true),
        (0.0, 1.5, true),
        (1.5, 1.25, false),
        (0.0, 0.5, false),
        (1.0, f64::NAN, false),
        (1.0, -1.0, false),
    ] {
        let w = CostWeights {
            load_bound: bound,
            load_bound_cached: cached,
            ..CostWeights::dynamo()
        };
        let errors = w.validate();
        assert_eq!(errors.is_empty(), ok, "{bound} {cached}: {errors:?}");
        assert!(
            errors.iter().all(|e| e.name == "load_bound_cached"),
            "{errors:?}"
        );
    }
}

/// `exact_below`: Dynamo's weights and power-of-two blocks qualify, anything else does not;
/// below the limit a cost summed in another order (a load key plus the prompt's share, less the
/// credit and the active share, as an ordered pick bounds it) is the same float, and with a
/// weight that is not a multiple of 2⁻¹⁰ it is not always.
#[test]
fn costs_below_exact_below_are_the_same_in_any_order() {
    let d = CostWeights::dynamo();
    assert_eq!(d.exact_below(16), f64::from(1u32 << 26));
    for (w, bs) in [
        (
            CostWeights {
                prefill_load_scale: 0.7,
                ..d
            },
            16,
        ),
        (
            CostWeights {
                host_cache_hit_weight: 0.1,
                ..d
            },
            16,
        ),
        (
            CostWeights {
                decode_active_request_weight: -1.0,
                ..d
            },
            16,
        ),
        (
            CostWeights {
                overlap_score_credit: 2048.0,
                ..d
            },
            16,
        ),
        (d, 12),
        (d, 1 << 17),
    ] {
        assert_eq!(w.exact_below(bs), 0.0, "{w:?} at block size {bs}");
    }
    // The same real sums in two orders: always equal floats with dyadic weights, not always
    // with 0.1 and 0.7.
    let sums = |w: &CostWeights, g: &mut fastrand::Rng| -> bool {
        let bs = [1u32, 4, 16, 64][g.usize(..4)];
        let limit = w.exact_below(bs).max(1e6) / 8.0;
        let (active_prefill, isl) = (g.u64(..1 << 16), g.u64(1..1 << 16));
        let blocks = isl / u64::from(bs);
        let (decode, held, requests) = (g.u64(..1 << 14), g.u64(..=blocks), g.u32(..64));
        let device = g.u64(..=blocks);
        let c = load(
            device,
            0,
            0,
            active_prefill + isl,
            decode + blocks - held,
            requests,
        );
        let inv = 1.0 / f64::from(bs);
        let key = w.prefill_load_scale * (active_prefill as f64 * inv)
            + decode as f64
            + w.decode_active_request_weight * f64::from(requests);
        let share = w.prefill_load_scale * (isl as f64 * inv) + blocks as f64;
        let bound = key + share - w.prefill_load_scale * w.overlap_credit(c.overlap) - held as f64;
        let clamped = (active_prefill + isl) as f64 * inv < w.overlap_credit(c.overlap);
        assert!(key < limit && share < limit);
        clamped || bound == w.cost(bs, &c)
    };
    let mut g = fastrand::Rng::with_seed(5);
    let dyadic = |g: &mut fastrand::Rng| [0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0][g.usize(..8)];
    for _ in 0..20_000 {
        let w = CostWeights {
            overlap_score_credit: dyadic(&mut g),
            host_cache_hit_weight: dyadic(&mut g),
            prefill_load_scale: dyadic(&mut g),
            decode_active_request_weight: dyadic(&mut g),
            ..d
        };
        assert!(w.exact_below(16) > 0.0);
        assert!(sums(&w, &mut g), "{w:?}");
    }
    let inexact = CostWeights {
        prefill_load_scale: 0.7,
        overlap_score_credit: 0.1,
        decode_active_request_weight: 0.3,
        ..d
    };
    let differ = (0..20_000).filter(|_| !sums(&inexact, &mut g)).count();
    assert!(differ > 0, "0.7, 0.1 and 0.3 never rounded apart");
}
