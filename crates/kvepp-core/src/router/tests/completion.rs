//! The `predicted_completion` cost and the objectives through the router: an engine decoding
//! many streams gives a conversation up sooner than under the TTFT alone, the end of each
//! response teaches the decode model, a TPOT objective passes over an engine predicted to decode
//! too slowly (and refuses when none can meet it), and speculative indexing keeps a burst that
//! shares a new prefix together before any KV event confirms it.

use std::time::Duration;

use super::*;
use crate::cost::{CostModel, CostWeights};
use crate::kv::KvSettings;
use crate::pick::tests::ep;

fn router(cost_model: CostModel) -> Router {
    let weights = CostWeights {
        cost_model,
        ..CostWeights::dynamo()
    };
    approx_router(KvSettings::default().approx_blocks_per_endpoint, weights)
}

/// A 1024-token shared head and a 32-token question of its own.
fn prompt(question: u8) -> Vec<u8> {
    let mut p = vec![9u8; 1024];
    p.extend([question; 32]);
    p
}

/// How many turns of one conversation (up to `MAX_TURNS`) stay on the engine that cached its head
/// while each of them keeps decoding there (first byte seen, booking held).
const MAX_TURNS: usize = 100;

fn turns_at_home(cost_model: CostModel) -> usize {
    let r = router(cost_model);
    let eps = vec![ep(1, 0), ep(2, 0)];
    let mut ctx = PickContext::seeded(3);
    let first = r.route(text(&prompt(1)), &eps, &mut ctx).unwrap();
    let home = first.pick.primary.addr;
    drop(first);
    let mut held = Vec::new();
    loop {
        let mut d = r
            .route(text(&prompt(2 + held.len() as u8)), &eps, &mut ctx)
            .unwrap();
        if d.pick.primary.addr != home || held.len() == MAX_TURNS {
            return held.len();
        }
        d.booking.first_byte();
        held.push(d);
    }
}

#[test]
fn the_whole_request_gives_up_a_busy_cached_engine_sooner_than_its_first_token() {
    // Decoding streams barely slow a first token: the TTFT alone keeps every turn at home.
    assert_eq!(turns_at_home(CostModel::PredictedTtft), MAX_TURNS);
    let completion = turns_at_home(CostModel::PredictedCompletion);
    assert!(
        (1..MAX_TURNS / 4).contains(&completion),
        "the completion kept {completion} turns at home"
    );
}

#[test]
fn the_end_of_each_response_teaches_the_decode_model_and_the_output_length() {
    let r = router(CostModel::PredictedCompletion);
    let eps = vec![ep(1, 0), ep(2, 0)];
    let mut ctx = PickContext::seeded(1);
    let model = r.kv.as_ref().unwrap().decode_model();
    // Without a first token, an end teaches nothing.
    let mut d = r.route(text(&prompt(1)), &eps, &mut ctx).unwrap();
    assert!(d.pick.kv.unwrap().decode.is_some());
    d.booking.finished(ctx.now + Duration::from_secs(1), 100);
    assert_eq!(model.observed(), 0);
    drop(d);
    for i in 0..40u8 {
        let mut d = r.route(text(&prompt(i)), &eps, &mut ctx).unwrap();
        d.booking.first_token(ctx.now + Duration::from_millis(50));
        // 301 tokens, 30 ms apart.
        d.booking
            .finished(ctx.now + Duration::from_millis(50 + 9000), 301);
        // A second end is ignored.
        d.booking.finished(ctx.now + Duration::from_secs(600), 2);
    }
    assert_eq!(model.observed(), 40);
    let mean = model.lengths().mean(Some("m"));
    assert!((mean - 301.0).abs() < 1e-6, "{mean}");
    let f = r
        .route(text(&prompt(99)), &eps, &mut ctx)
        .unwrap()
        .pick
        .kv
        .unwrap()
        .decode
        .unwrap();
    assert!(
        (f.output_tokens - 301.0).abs() < 1e-6,
        "the learned length: {f:?}"
    );
    let itl = model.itl_ms(&f);
    assert!((itl - 30.0).abs() < 3.0, "learned step {itl} ms");
}

#[test]
fn a_tpot_objective_passes_over_a_slow_engine_and_refuses_when_none_meets_it() {
    // The TTFT alone prices the pick: the cached engine wins it however busy its decode is.
    let r = router(CostModel::PredictedTtft);
    let eps = vec![ep(1, 0), ep(2, 0)];
    let mut ctx = PickContext::seeded(2);
    // Port 1 caches the head, then decodes 60 short streams.
    drop(r.route(text(&prompt(1)), &eps[..1], &mut ctx).unwrap());
    let streams: Vec<_> = (0..60u8)
        .map(|i| {
            let mut d = r.route(text(&[i; 8]), &eps[..1], &mut ctx).unwrap();
            d.booking.first_byte();
            d
        })
        .collect();
    let q = prompt(2);
    let free = r.route(text(&q), &eps, &mut ctx).unwrap();
    assert_eq!(free.pick.primary.addr, eps[0].addr, "the cache wins");
    let busy = free.pick.kv.unwrap().decode.unwrap();
    drop(free);
    let model = r.kv.as_ref().unwrap().decode_model();
    let idle = crate::decode::DecodeFeatures { batch: 1.0, ..busy };
    let (busy, idle) = (model.itl_ms(&busy), model.itl_ms(&idle));
    assert!(busy > idle, "{busy} vs {idle}");
    fn facts(tpot: f64, bytes: &[u8]) -> RequestFacts<'_> {
        RequestFacts {
            admission: Admission::Unsaturated,
            tpot_budget_ms: Some(tpot),
            ..text(bytes)
        }
    }
    let budget = (busy + idle) / 2.0;
    let d = r.route(facts(budget, &q), &eps, &mut ctx).unwrap();
    assert_eq!(d.pick.primary.addr, eps[1].addr);
    let kv = d.pick.kv.unwrap();
    assert!(kv.objective_filtered, "the objective moved the pick");
    let outlook = kv.objective.unwrap();
    assert!(outlook.itl_ms.unwrap() <= budget, "{outlook:?}");
    drop(d);
    // Nobody meets half the idle step: refused, with both figures.
    match r.route(facts(idle / 2.0, &q), &eps, &mut ctx) {
        Err(PickError::OverTpotObjective {
            predicted_us,
            budget_us,
            floor_us,
        }) => assert!(
            predicted_us > budget_us && floor_us > budget_us && floor_us <= predicted_us,
            "{predicted_us} vs {budget_us}, idle {floor_us}"
        ),
        other => panic!("expected a refusal, got {other:?}"),
    }
    // Admitted to shed (no flow control): routed anyway.
    let shed = RequestFacts {
        admission: Admission::Shed,
        ..facts(idle / 2.0, &q)
    };
    assert!(r.route(shed, &eps, &mut ctx).is_ok());
    drop(streams);
}

/// A burst of requests sharing a new 1024-token prefix, sent before any engine reports it cached
/// (no KV events at all): each prefilled and decoding while the next is picked.
fn burst(speculative: bool) -> (usize, u64) {
    let kv = Arc::new(KvState::new(KvSettings {
        block_size: 4,
        weights: CostWeights {
            speculative,
            ..CostWeights::default()
        },
        ..KvSettings::default()
    }));
    let r = Router::kv_aware(kv, Saturation::in_flight(0));
    let eps = vec![ep(1, 0), ep(2, 0), ep(3, 0), ep(4, 0)];
    let mut ctx = PickContext::seeded(4);
    let mut held = Vec::new();
    let mut overlap = 0;
    for i in 0..4u32 {
        let mut ids: Vec<u32> = (0..1024).collect();
        ids.extend([1000 + i; 8]);
        let facts = RequestFacts {
            model: Some("m"),
            prompt: Prompt::TokenIds(ids),
            ..RequestFacts::default()
        };
        let mut d = r.route(facts, &eps, &mut ctx).unwrap();
        d.booking.first_byte();
        overlap += d.pick.kv.unwrap().overlap.device;
        held.push(d.pick.primary.addr);
        std::mem::forget(d.booking);
    }
    held.sort();
    held.dedup();
    (held.len(), overlap)
}

#[test]
fn speculative_indexing_keeps_a_burst_on_the_engine_its_first_request_went_to() {
    let (engines, overlap) = burst(true);
    // Each of the three later requests finds the 256 blocks its predecessors hold.
    assert_eq!((engines, overlap), (1, 3 * 256));
    let (engines, overlap) = burst(false);
    assert_eq!(overlap, 0, "nothing confirmed, nothing cached");
    assert!(engines > 1, "the burst spreads over cold engines");
}
