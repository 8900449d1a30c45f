//! The `predicted_ttft` cost model through the router: the cache still wins when it saves time,
//! a saturated holder of a hot prefix hands it to another endpoint, and observed first tokens
//! teach each endpoint's model its own speed.

use std::time::Duration;

use super::*;
use crate::cost::{CostModel, CostWeights};
use crate::kv::KvSettings;
use crate::pick::tests::ep;

fn ttft_router() -> Router {
    let kv = Arc::new(KvState::new(KvSettings {
        block_size: 4,
        approx_bytes_per_token: 1,
        approximate_only: true,
        weights: CostWeights {
            cost_model: CostModel::PredictedTtft,
            ..CostWeights::dynamo()
        },
        ..KvSettings::default()
    }));
    Router::kv_aware(kv, Saturation::in_flight(0))
}

/// A 256-token shared head and a 64-token question of its own.
fn prompt(question: u8) -> Vec<u8> {
    let mut p = vec![7u8; 256];
    p.extend([question; 64]);
    p
}

#[test]
fn the_cached_endpoint_wins_until_its_queue_costs_more_than_the_prefill_it_saves() {
    let r = ttft_router();
    // Both already carry 20 requests (from elsewhere): the load bound stays out of the way.
    let eps = vec![ep(1, 20), ep(2, 20)];
    let mut ctx = PickContext::seeded(1);
    // A first request caches the head at home and finishes.
    let first = r.route(text(&prompt(1)), &eps, &mut ctx).unwrap();
    let home = first.pick.primary.addr;
    assert!(
        first.pick.kv.unwrap().ttft.is_some(),
        "the decision records what the prediction read"
    );
    drop(first);
    // The next ones are held: their questions queue up at home.
    let mut held = Vec::new();
    let mut at_home = 0;
    loop {
        let d = r
            .route(text(&prompt(2 + held.len() as u8)), &eps, &mut ctx)
            .unwrap();
        let kv = d.pick.kv.unwrap();
        if d.pick.primary.addr != home {
            // The other endpoint took the hot prefix over: it had to prefill all of it, and
            // that was predicted faster than waiting behind home's queue.
            assert_eq!(kv.overlap.device, 0);
            break;
        }
        assert_eq!(kv.overlap.device, 64, "home holds the 256-token head");
        at_home += 1;
        held.push(d);
        assert!(at_home < 20, "home never gave way");
    }
    // At home k queued questions of 64 tokens, its own 64 and the 64 it adds to the cache;
    // elsewhere 320 tokens to compute and 320 added to the cache: home takes eight (128 … 576),
    // the ninth (640, and more decoding KV) goes elsewhere.
    assert_eq!(at_home, 8);
    drop(held);
    // Idle again: the cache wins.
    let d = r.route(text(&prompt(99)), &eps, &mut ctx).unwrap();
    let other = d.pick.primary.addr;
    drop(d);
    assert!(eps.iter().any(|e| e.addr == other));
}

#[test]
fn observed_first_tokens_teach_each_endpoint_its_speed() {
    let r = ttft_router();
    let eps = vec![ep(1, 0), ep(2, 0)];
    let mut ctx = PickContext::seeded(5);
    // The slow endpoint takes 2 s to a first token, the fast one 20 ms, for any prompt.
    let slow = eps[0].addr;
    for i in 0..120u8 {
        let mut d = r.route(text(&prompt(i)), &eps, &mut ctx).unwrap();
        let took = if d.pick.primary.addr == slow {
            2000
        } else {
            20
        };
        d.booking.first_token(ctx.now + Duration::from_millis(took));
        // A second first token is ignored.
        d.booking.first_token(ctx.now + Duration::from_secs(60));
    }
    let (s, f) = (&eps[0].load.ttft, &eps[1].load.ttft);
    assert!(s.observed() >= 1 && f.observed() >= 1, "both were tried");
    let model = r.kv.as_ref().unwrap().ttft_model();
    let probe = crate::predict::TtftFeatures {
        prefill_ktokens: 0.32,
        ..Default::default()
    };
    assert!(
        // The shared coefficients are bounded (a multiple of the prior), so the slowness is the
        // endpoint's own factor's to learn, at most ×1.22 an observation. The first first token
        // of all tells the pool's ratio, not an endpoint's (nothing to compare it with yet); from
        // the fast one's on, the slow one is known slower than the pool and ranked last.
        model.predict(s, &probe, ctx.now) > 1.15 * model.predict(f, &probe, ctx.now),
        "slow {} vs fast {} (factors {} and {})",
        model.predict(s, &probe, ctx.now),
        model.predict(f, &probe, ctx.now),
        s.factor(),
        f.factor()
    );
    // Now even the slow endpoint's cached prefix does not bring requests back to it.
    for i in 0..10u8 {
        let d = r.route(text(&prompt(200 + i)), &eps, &mut ctx).unwrap();
        assert_ne!(d.pick.primary.addr, slow);
    }
    // Left without observations, its factor decays: two minutes on, requests that pile up on
    // the fast endpoint spill over to it sooner (and it is relearned from what it does then)
    // instead of it starving for good.
    let spilled = |ctx: &mut PickContext, first: u8| {
        let held: Vec<_> = (first..first + 20)
            .map(|i| r.route(text(&prompt(i)), &eps, ctx).unwrap())
            .collect();
        held.iter().filter(|d| d.pick.primary.addr == slow).count()
    };
    let now = spilled(&mut ctx, 120);
    ctx.now += Duration::from_secs(120);
    let later = spilled(&mut ctx, 140);
    assert!(
        later > now,
        "{later} vs {now}, factor now {}",
        s.factor_at(ctx.now)
    );
}
