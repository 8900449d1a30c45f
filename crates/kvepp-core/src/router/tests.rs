//! The KV-aware picker through the router: cost ties, load and recency tie-breaks, temperature, the approximate
//! FIFO bound, forgetting an endpoint, booking release and upkeep.

use std::time::Duration;

use super::*;
use crate::cost::CostWeights;
use crate::kv::KvSettings;
use crate::pick::tests::ep;
use crate::slots::STALE_REQUEST_AFTER;

fn approx_router(cap: usize, weights: CostWeights) -> Router {
    let kv = Arc::new(KvState::new(KvSettings {
        block_size: 4,
        approx_bytes_per_token: 1,
        approx_blocks_per_endpoint: cap,
        approximate_only: true,
        weights,
        ..KvSettings::default()
    }));
    Router::kv_aware(kv, Saturation::in_flight(0))
}

pub(super) fn text(bytes: &[u8]) -> RequestFacts<'_> {
    RequestFacts {
        model: Some("m"),
        prompt: Prompt::Text { scope: "m", bytes },
        ..RequestFacts::default()
    }
}

/// Cached blocks of `bytes` on the primary of a fresh pick among `eps` (booking dropped at once).
fn overlap_on(r: &Router, eps: &[Arc<Endpoint>], bytes: &[u8]) -> (SocketAddr, u64) {
    let d = r
        .route(text(bytes), eps, &mut PickContext::seeded(9))
        .unwrap();
    let kv = d.pick.kv.unwrap();
    (d.pick.primary.addr, kv.overlap.device)
}

#[test]
fn equal_costs_go_to_fewer_in_flight_then_to_the_least_recently_booked() {
    let r = approx_router(64, CostWeights::dynamo());
    // No prompt: every cost is 0; the endpoint with fewer requests in flight wins every time.
    let eps = vec![ep(1, 3), ep(2, 0), ep(3, 5)];
    let mut ctx = PickContext::seeded(1);
    for _ in 0..50 {
        let d = r.route(RequestFacts::default(), &eps, &mut ctx).unwrap();
        assert_eq!(d.pick.primary.addr, eps[1].addr);
        assert_eq!(d.mode, PrefixMode::None);
    }
    // Equal costs and equal in-flight: the endpoint booked least recently, so they take turns.
    let eps = vec![ep(1, 2), ep(2, 2)];
    let mut seen = Vec::new();
    for _ in 0..200 {
        let d = r.route(RequestFacts::default(), &eps, &mut ctx).unwrap();
        seen.push(usize::from(d.pick.primary.addr != eps[0].addr));
        assert_ne!(
            d.pick.fallback.as_ref().map(|f| f.addr),
            Some(d.pick.primary.addr)
        );
        drop(d);
    }
    assert!(
        seen.windows(2).all(|w| w[0] != w[1]),
        "ties do not take turns: {seen:?}"
    );
    // Never booked, both: at random.
    let mut firsts = [0u32; 2];
    for seed in 0..200 {
        let eps = vec![ep(1, 0), ep(2, 0)];
        let d = r
            .route(
                RequestFacts::default(),
                &eps,
                &mut PickContext::seeded(seed),
            )
            .unwrap();
        firsts[usize::from(d.pick.primary.addr != eps[0].addr)] += 1;
    }
    assert!(
        firsts[0] > 40 && firsts[1] > 40,
        "first ties not spread: {firsts:?}"
    );
}

/// New prefixes, one at a time, on idle endpoints under the shipped cost: each costs the same
/// everywhere, so they take turns instead of piling up by chance on one engine's cache.
#[test]
fn new_prefixes_on_idle_endpoints_take_turns() {
    let r = approx_router(1024, CostWeights::default());
    let eps = vec![ep(1, 0), ep(2, 0), ep(3, 0)];
    let mut ctx = PickContext::seeded(3);
    let mut counts = [0u32; 3];
    for g in 0..30u32 {
        let body = format!("{g:04} a prompt of its own {}", "x".repeat(64));
        let d = r.route(text(body.as_bytes()), &eps, &mut ctx).unwrap();
        assert_eq!(d.pick.kv.unwrap().overlap.device, 0, "a new prefix");
        counts[eps
            .iter()
            .position(|e| e.addr == d.pick.primary.addr)
            .unwrap()] += 1;
        drop(d);
    }
    assert_eq!(counts, [10; 3]);
}

#[test]
fn cached_prefix_wins_at_temperature_zero_and_temperature_spreads() {
    let r = approx_router(64, CostWeights::dynamo());
    let eps = vec![ep(1, 0), ep(2, 0)];
    let prompt = [7u8; 64]; // 16 blocks of 4 bytes
    let first = r
        .route(text(&prompt), &eps, &mut PickContext::seeded(3))
        .unwrap();
    let home = first.pick.primary.addr;
    drop(first);
    for seed in 0..20 {
        let (addr, overlap) = {
            let d = r
                .route(text(&prompt), &eps, &mut PickContext::seeded(seed))
                .unwrap();
            (d.pick.primary.addr, d.pick.kv.unwrap().overlap.device)
        };
        assert_eq!(addr, home, "the endpoint holding the prefix is cheapest");
        assert_eq!(overlap, 16);
    }
    // A high temperature samples: the other endpoint is chosen sometimes.
    let hot = approx_router(
        64,
        CostWeights {
            temperature: 5.0,
            ..CostWeights::dynamo()
        },
    );
    let d = hot
        .route(text(&prompt), &eps, &mut PickContext::seeded(3))
        .unwrap();
    let home = d.pick.primary.addr;
    drop(d);
    let away = (0..200)
        .filter(|&s| {
            hot.route(text(&prompt), &eps, &mut PickContext::seeded(s))
                .unwrap()
                .pick
                .primary
                .addr
                != home
        })
        .count();
    assert!(away > 0, "temperature 5 never left the cheapest endpoint");
}

#[test]
fn approximate_memory_is_bounded_per_endpoint() {
    let r = approx_router(4, CostWeights::dynamo());
    let eps = vec![ep(1, 0)];
    let a = [1u8; 8]; // 2 blocks
    drop(
        r.route(text(&a), &eps, &mut PickContext::seeded(1))
            .unwrap(),
    );
    assert_eq!(overlap_on(&r, &eps, &a).1, 2);
    // Two other 2-block prompts push a's four references out of the 4-block FIFO.
    for other in [[2u8; 8], [3u8; 8], [4u8; 8]] {
        drop(
            r.route(text(&other), &eps, &mut PickContext::seeded(1))
                .unwrap(),
        );
    }
    assert_eq!(overlap_on(&r, &eps, &a).1, 0, "oldest blocks evicted");
    assert_eq!(overlap_on(&r, &eps, &[4u8; 8]).1, 2, "newest kept");
}

#[test]
fn forgetting_an_endpoint_drops_its_prefixes_and_load() {
    let r = approx_router(64, CostWeights::dynamo());
    let eps = vec![ep(1, 0)];
    let p = [5u8; 16];
    let held = r
        .route(text(&p), &eps, &mut PickContext::seeded(1))
        .unwrap();
    let kv = r.kv().unwrap().clone();
    let addr = eps[0].addr_str.clone();
    assert_eq!(kv.load(&addr).map(|l| l.active_requests), Some(1));
    assert_eq!(overlap_on(&r, &eps, &p).1, 4);
    r.forget(&addr);
    assert_eq!(kv.load(&addr), None, "load forgotten");
    assert_eq!(overlap_on(&r, &eps, &p).1, 0, "prefix forgotten");
    drop(held);
}

#[test]
fn booking_is_released_once_on_drop_and_stale_ones_expire() {
    let r = approx_router(64, CostWeights::dynamo());
    let eps = vec![ep(1, 0)];
    let kv = r.kv().unwrap().clone();
    let addr = eps[0].addr_str.clone();
    let now = Instant::now();
    let mut ctx = PickContext::new(fastrand::Rng::with_seed(1), now);
    let mut d = r.route(text(&[9u8; 16]), &eps, &mut ctx).unwrap();
    assert_eq!(eps[0].load.in_flight(), 1);
    let l = kv.load(&addr).unwrap();
    assert_eq!((l.active_requests, l.active_prefill_tokens), (1, 16));
    d.booking.first_byte();
    assert_eq!(kv.load(&addr).unwrap().active_prefill_tokens, 0);
    drop(d);
    assert_eq!(eps[0].load.in_flight(), 0);
    assert_eq!(kv.load(&addr).unwrap().active_requests, 0);

    // A request whose end is never seen is expired by upkeep, in approximate mode too.
    let lost = r.route(text(&[9u8; 16]), &eps, &mut ctx).unwrap();
    std::mem::forget(lost);
    assert_eq!(r.maintain(now + Duration::from_secs(1)), 0);
    assert_eq!(
        r.maintain(now + STALE_REQUEST_AFTER + Duration::from_secs(1)),
        1
    );
    assert_eq!(kv.load(&addr).unwrap().active_requests, 0);
}

#[test]
fn load_only_router_books_in_flight_without_prompt_work() {
    let r = Router::load_only(Box::new(crate::LeastLoaded), Saturation::in_flight(2));
    assert!(!r.wants_prompt());
    let eps = vec![ep(1, 2), ep(2, 1)];
    let mut ctx = PickContext::seeded(1);
    let d = r.route(text(&[1u8; 16]), &eps, &mut ctx).unwrap();
    assert_eq!(d.pick.primary.addr, eps[1].addr);
    assert!(d.pick.kv.is_none());
    assert_eq!(eps[1].load.in_flight(), 2);
    let shed = RequestFacts {
        priority: crate::Criticality::Sheddable.priority(),
        ..RequestFacts::default()
    };
    assert_eq!(
        r.route(shed, &eps, &mut ctx).unwrap_err(),
        PickError::Saturated(2)
    );
    drop(d);
    assert_eq!(eps[1].load.in_flight(), 1);
    assert_eq!(r.maintain(Instant::now()), 0);
}

#[test]
fn retain_keeps_only_live_endpoints() {
    let r = approx_router(64, CostWeights::dynamo());
    let (a, b) = (ep(1, 0), ep(2, 0));
    let p = [6u8; 16];
    let held = r
        .route(
            text(&p),
            std::slice::from_ref(&a),
            &mut PickContext::seeded(1),
        )
        .unwrap();
    drop(
        r.route(
            text(&p),
            std::slice::from_ref(&b),
            &mut PickContext::seeded(1),
        )
        .unwrap(),
    );
    let kv = r.kv().unwrap().clone();
    assert_eq!(r.retain([&*a.addr_str, &*b.addr_str]), 0);
    assert_eq!(r.retain([&*b.addr_str]), 1, "a is not live");
    assert_eq!(kv.load(&a.addr_str), None);
    assert!(kv.load(&b.addr_str).is_some());
    assert_eq!(overlap_on(&r, std::slice::from_ref(&a), &p).1, 0);
    assert_eq!(overlap_on(&r, std::slice::from_ref(&b), &p).1, 4);
    drop(held);
    assert_eq!(
        Router::load_only(Box::new(crate::LeastLoaded), Saturation::in_flight(0)).retain([]),
        0
    );
}

/// Live reconfiguration: new weights, saturation limits and session limits apply to the next
/// decision; a booking made before keeps its load.
#[test]
fn retune_applies_to_the_next_decision() {
    let r = approx_router(64, CostWeights::dynamo());
    let eps = vec![ep(1, 0), ep(2, 0)];
    let prompt = [7u8; 64];
    let home = r
        .route(text(&prompt), &eps, &mut PickContext::seeded(3))
        .unwrap()
        .pick
        .primary
        .addr;
    // Temperature 0: always the endpoint holding the prefix.
    let away = |r: &Router| {
        (0..200)
            .filter(|&s| {
                r.route(text(&prompt), &eps, &mut PickContext::seeded(s))
                    .unwrap()
                    .pick
                    .primary
                    .addr
                    != home
            })
            .count()
    };
    assert_eq!(away(&r), 0);
    let sessions = crate::affinity::SessionAffinity::default();
    let hot = CostWeights {
        temperature: 5.0,
        ..CostWeights::dynamo()
    };
    r.retune(hot, r.tuning(), &sessions);
    assert!(away(&r) > 0, "the new temperature was not used");
    // A saturation limit of one request in flight: with a booking held on each endpoint, the
    // next request finds the pool saturated.
    let held = r
        .route(text(b"a"), &eps[..1], &mut PickContext::seeded(1))
        .unwrap();
    let held2 = r
        .route(text(b"b"), &eps[1..], &mut PickContext::seeded(1))
        .unwrap();
    let facts = || RequestFacts {
        admission: Admission::Unsaturated,
        ..text(b"c")
    };
    assert!(r.route(facts(), &eps, &mut PickContext::seeded(1)).is_ok());
    let tight = crate::pick::Tuning {
        saturation: Saturation::in_flight(1),
        ..r.tuning()
    };
    r.retune(CostWeights::dynamo(), tight, &sessions);
    assert!(matches!(
        r.route(facts(), &eps, &mut PickContext::seeded(1)),
        Err(crate::pick::PickError::Saturated(2))
    ));
    drop((held, held2));
    assert!(r.route(facts(), &eps, &mut PickContext::seeded(1)).is_ok());
}

#[test]
fn shrinking_the_session_table_sheds_the_least_recently_used() {
    use crate::affinity::{SessionKey, Sessions};
    let t = Sessions::new(Duration::from_secs(60), 1_000);
    let rank = WorkerRank {
        worker: 1,
        dp_rank: 0,
    };
    let keys: Vec<SessionKey> = (0..400)
        .map(|i| SessionKey::parse(format!("s{i}").as_bytes()).unwrap())
        .collect();
    for (i, k) in keys.iter().enumerate() {
        t.bind(*k, rank, i as i64);
    }
    assert_eq!(
        keys.iter().filter(|k| t.get(**k, 400).is_some()).count(),
        400
    );
    // 16 shards of at most one binding each: the next bindings shed down to that.
    t.set_limits(Duration::from_secs(60), 16);
    let fresh: Vec<SessionKey> = (0..400)
        .map(|i| SessionKey::parse(format!("t{i}").as_bytes()).unwrap())
        .collect();
    for (i, k) in fresh.iter().enumerate() {
        t.bind(*k, rank, 1_000 + i as i64);
    }
    let live = |keys: &[SessionKey], now| keys.iter().filter(|k| t.get(**k, now).is_some()).count();
    assert_eq!(
        live(&keys, 2_000),
        0,
        "the old bindings were least recently used"
    );
    assert!(live(&fresh, 2_000) <= 16);
    assert!(t.evictions() >= 384);
    // A shorter time to live expires bindings at once.
    t.set_limits(Duration::from_nanos(10), 16);
    assert_eq!(live(&fresh, 1_000_000), 0);
}

/// The TTFT objective: under the predicted-TTFT cost and `Admission::Unsaturated`, a choice
/// predicted slower than the budget left is refused (flow control holds the request); with room,
/// or admitted to shed (no flow control), or under Dynamo's cost, it routes.
#[test]
fn a_choice_predicted_over_the_ttft_budget_is_refused_until_one_fits() {
    let r = approx_router(
        64,
        CostWeights {
            cost_model: crate::cost::CostModel::PredictedTtft,
            ..CostWeights::dynamo()
        },
    );
    let eps = vec![ep(1, 0), ep(2, 0)];
    let prompt = vec![3u8; 4096];
    let facts = |budget: f64, admission| RequestFacts {
        admission,
        ttft_budget_ms: Some(budget),
        ..text(&prompt)
    };
    let d = r
        .route(
            facts(1e9, Admission::Unsaturated),
            &eps,
            &mut PickContext::seeded(1),
        )
        .unwrap();
    let outlook = d.pick.kv.unwrap().objective.unwrap();
    let predicted = outlook.predicted_ms;
    assert!(predicted > 0.0, "{predicted}");
    // Idle, with nothing queued: the floor is at most the prediction.
    assert!(outlook.floor_ms <= predicted + 1e-9, "{outlook:?}");
    drop(d);
    match r.route(
        facts(predicted / 2.0, Admission::Unsaturated),
        &eps,
        &mut PickContext::seeded(1),
    ) {
        Err(crate::pick::PickError::OverObjective {
            predicted_ms,
            budget_ms,
            floor_ms,
        }) => assert!(
            predicted_ms > budget_ms && floor_ms <= predicted_ms,
            "{predicted_ms} {budget_ms} {floor_ms}"
        ),
        other => panic!("{other:?}"),
    }
    assert!(r
        .route(
            facts(predicted / 2.0, Admission::Shed),
            &eps,
            &mut PickContext::seeded(1)
        )
        .is_ok());
    // Dynamo's cost predicts no time: no objective applies.
    let dynamo = approx_router(64, CostWeights::dynamo());
    assert!(dynamo
        .route(
            facts(0.0, Admission::Unsaturated),
            &eps,
            &mut PickContext::seeded(1)
        )
        .is_ok());
}

/// A tokenized prompt given as the pieces it was assembled from is the same prompt as its ids in
/// one array: the same blocks, and its next turn (the same pieces and one more) reuses them.
#[test]
fn a_prompt_in_pieces_has_the_blocks_of_its_ids_in_one_array() {
    let r = Router::kv_aware(
        Arc::new(KvState::new(KvSettings::default())),
        Saturation::in_flight(0),
    );
    let mut rng = fastrand::Rng::with_seed(8);
    let mut piece = |n: usize| -> Arc<[u32]> { (0..n).map(|_| rng.u32(..50_000)).collect() };
    // Segments of odd lengths (blocks straddle them) and one-id added tokens.
    let mut pieces: Vec<Arc<[u32]>> = vec![piece(1), piece(700), piece(1), piece(37), piece(1)];
    for turn in 0..3 {
        let flat: Vec<u32> = pieces.iter().flat_map(|p| p.iter().copied()).collect();
        let a = r.blocks(None, Prompt::Pieces(pieces.clone())).unwrap();
        let b = r.blocks(None, Prompt::Tokens(flat.clone())).unwrap();
        assert_eq!(
            (a.mode, &a.locals, &a.hashes),
            (b.mode, &b.locals, &b.hashes),
            "turn {turn}"
        );
        assert_eq!(a.isl_tokens, flat.len() as u64);
        pieces.extend([piece(1), piece(123), piece(1)]);
    }
    let stats = r.kv().unwrap().prompt_hash_stats();
    assert!(
        stats.blocks_reused > 0,
        "later turns reuse earlier blocks: {stats:?}"
    );
}

mod affinity;
mod completion;
mod doors;
mod pd;
mod ttft;
