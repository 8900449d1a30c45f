//! Adapter and session affinity through the router: the adapter term's order (loaded, free slot,
//! eviction; saturation loses the advantage), both legs of a disaggregated pick, and sessions that
//! stick, move when their endpoint is gone, saturated or outside the subset, and stick again.

use parking_lot::Mutex;

use super::*;
use crate::affinity::{AdapterFit, AdapterSlots, SessionAffinity, SessionKey, SessionOutcome};
use crate::disagg::Role;
use crate::kv::KvSettings;
use crate::load::EngineMetrics;
use crate::pick::tests::ep;
use crate::types::WorkerRank;

fn kv_router(saturation: Saturation, adapters: AdapterAffinity) -> Router {
    let kv = Arc::new(KvState::new(KvSettings {
        block_size: 4,
        ..KvSettings::default()
    }));
    kv.learn_base_model("base");
    Router::kv_aware(kv, saturation).with_adapter_affinity(adapters)
}

fn slots(running: &[&str], max_lora: u32) -> Option<AdapterSlots> {
    Some(AdapterSlots {
        running: running.iter().map(|&a| a.into()).collect(),
        waiting: Vec::new(),
        max_lora,
        from_metadata: false,
    })
}

fn facts(model: &str, session: Option<SessionKey>) -> RequestFacts<'_> {
    RequestFacts {
        model: Some(model),
        prompt: Prompt::TokenIds((0..40).collect()),
        session,
        ..RequestFacts::default()
    }
}

fn by_queue() -> Saturation {
    Saturation {
        queue_threshold: 5,
        kv_cache_threshold: f64::INFINITY,
        ..Saturation::default()
    }
}

/// Two engines saturated alike, each running one adapter in its only slot: a request for the
/// first's adapter stays there (the other would load it and evict its own), however many go
/// there in a row (the least-recently-booked tie-break never applies: the costs differ).
#[test]
fn of_two_engines_saturated_alike_the_one_holding_the_adapter_keeps_it() {
    let r = kv_router(by_queue(), AdapterAffinity::default());
    let eps = vec![ep(1, 1), ep(2, 1)];
    eps[0].load.set_adapters(slots(&["a"], 1));
    eps[1].load.set_adapters(slots(&["b"], 1));
    let mut ctx = PickContext::seeded(11);
    let queued = EngineMetrics {
        waiting: 9.0,
        ..EngineMetrics::default()
    };
    for e in &eps {
        e.load.engine_update(queued, ctx.now);
    }
    for _ in 0..10 {
        let d = r.route(facts("a", None), &eps, &mut ctx).unwrap();
        assert_eq!(d.pick.primary.addr, eps[0].addr);
        assert_eq!(d.pick.adapter, Some(AdapterFit::Saturated));
    }
}

#[test]
fn adapter_requests_go_where_it_runs_then_to_a_free_slot_never_to_an_eviction() {
    let r = kv_router(by_queue(), AdapterAffinity::default());
    // Comparable loads: one request each.
    let eps = vec![ep(1, 1), ep(2, 1), ep(3, 1)];
    eps[0].load.set_adapters(slots(&["a"], 2));
    eps[1].load.set_adapters(slots(&["b"], 2));
    eps[2].load.set_adapters(slots(&["b", "c"], 2));
    let mut ctx = PickContext::seeded(5);
    for _ in 0..20 {
        let d = r.route(facts("a", None), &eps, &mut ctx).unwrap();
        assert_eq!(d.pick.primary.addr, eps[0].addr);
        assert_eq!(d.pick.adapter, Some(AdapterFit::Loaded));
    }
    // The base model has no adapter term: the three are alike.
    let d = r.route(facts("base", None), &eps, &mut ctx).unwrap();
    assert_eq!(d.pick.adapter, None);
    // The engine running it saturates: an unsaturated engine with a free slot, not the full one.
    let queued = EngineMetrics {
        waiting: 9.0,
        ..EngineMetrics::default()
    };
    eps[0].load.engine_update(queued, ctx.now);
    for k in 0..20 {
        let d = r.route(facts("a", None), &eps, &mut ctx).unwrap();
        assert_eq!(d.pick.primary.addr, eps[1].addr);
        // Loaded by the first: the router remembers what it sent there (vLLM's metric does not
        // list an adapter idle between requests).
        let want = if k == 0 {
            AdapterFit::FreeSlot
        } else {
            AdapterFit::Loaded
        };
        assert_eq!(d.pick.adapter, Some(want));
    }
    assert_eq!(
        eps[1].load.recent_adapters.load().first().map(|a| &**a),
        Some("a")
    );
    // Unknown adapters (no metric) are no preference, and an adapter no engine runs goes to the
    // free slot first.
    eps[1].load.set_adapters(None);
    let d = r.route(facts("z", None), &eps[1..], &mut ctx).unwrap();
    assert_eq!(
        d.pick.primary.addr, eps[1].addr,
        "unknown (0) before evicting"
    );
    assert_eq!(d.pick.adapter, Some(AdapterFit::Unknown));
}

#[test]
fn adapter_affinity_off_is_adapter_blind() {
    let off = AdapterAffinity {
        enabled: false,
        ..AdapterAffinity::default()
    };
    let r = kv_router(Saturation::in_flight(0), off);
    let eps = vec![ep(1, 0), ep(2, 0)];
    eps[0].load.set_adapters(slots(&["a"], 1));
    eps[1].load.set_adapters(slots(&["b"], 1));
    let mut ctx = PickContext::seeded(2);
    let mut seen = [0; 2];
    for _ in 0..100 {
        let d = r.route(facts("a", None), &eps, &mut ctx).unwrap();
        seen[usize::from(d.pick.primary.addr == eps[1].addr)] += 1;
    }
    assert!(seen[0] > 20 && seen[1] > 20, "{seen:?}");
}

#[test]
fn both_legs_of_a_disaggregated_pick_prefer_the_adapter() {
    let r = kv_router(Saturation::in_flight(0), AdapterAffinity::default())
        .with_disaggregation(TransferSettings::default());
    let role = |port, role| {
        let mut e = Endpoint::new(([127, 0, 0, 1], port).into(), format!("pod-{port}"));
        e.role = role;
        Arc::new(e)
    };
    let eps = vec![
        role(1, Role::Prefill),
        role(2, Role::Prefill),
        role(3, Role::Decode),
        role(4, Role::Decode),
    ];
    for (e, a) in eps.iter().zip(["x", "a", "x", "a"]) {
        e.load.set_adapters(slots(&[a], 1));
    }
    let mut ctx = PickContext::seeded(4);
    let long = RequestFacts {
        model: Some("a"),
        prompt: Prompt::TokenIds((0..4000).collect()),
        ..RequestFacts::default()
    };
    for _ in 0..10 {
        let d = r.route(long.clone(), &eps, &mut ctx).unwrap();
        assert_eq!(d.pick.primary.addr, eps[3].addr);
        let p = d.pick.pairing.as_ref().expect("disaggregated");
        assert_eq!(p.prefill.addr, eps[1].addr);
    }
}

#[derive(Debug, Default)]
struct Bound(Mutex<Vec<(SessionKey, WorkerRank)>>);

impl Listener for Bound {
    fn session_bound(&self, key: SessionKey, rank: WorkerRank) {
        self.0.lock().push((key, rank));
    }
}

#[test]
fn sessions_stick_move_when_their_endpoint_cannot_take_them_and_stick_again() {
    let r = kv_router(Saturation::in_flight(3), AdapterAffinity::default())
        .with_sessions(SessionAffinity::default().table());
    let heard = Arc::new(Bound::default());
    r.listen(heard.clone());
    let eps = vec![ep(1, 0), ep(2, 0), ep(3, 0)];
    let s = Some(SessionKey::of("chat-1"));
    let mut ctx = PickContext::seeded(8);
    let first = r.route(facts("base", s), &eps, &mut ctx).unwrap();
    assert_eq!(first.session, Some(SessionOutcome::New));
    let home = first.pick.primary.clone();
    let mut held = vec![first];
    // It sticks while its endpoint is busier than the others (and the others are cheaper).
    for _ in 0..2 {
        let d = r.route(facts("base", s), &eps, &mut ctx).unwrap();
        assert_eq!(d.session, Some(SessionOutcome::Hit));
        assert_eq!(d.pick.primary.addr, home.addr);
        assert!(d
            .pick
            .fallback
            .as_ref()
            .is_some_and(|f| f.addr != home.addr));
        held.push(d);
    }
    assert_eq!(home.load.in_flight(), 3);
    let d = r.route(facts("base", None), &eps, &mut ctx).unwrap();
    assert_ne!(d.pick.primary.addr, home.addr, "no session: the cheapest");
    assert_eq!(d.session, None);
    drop(d);
    // Saturated (3 in flight): it moves, then sticks to the new endpoint.
    let moved = r.route(facts("base", s), &eps, &mut ctx).unwrap();
    assert_eq!(moved.session, Some(SessionOutcome::Moved));
    let next = moved.pick.primary.clone();
    assert_ne!(next.addr, home.addr);
    drop(moved);
    held.clear();
    let d = r.route(facts("base", s), &eps, &mut ctx).unwrap();
    assert_eq!(
        (d.session, d.pick.primary.addr),
        (Some(SessionOutcome::Hit), next.addr)
    );
    drop(d);
    // Its endpoint leaves the pool: it moves and sticks there.
    let rest: Vec<_> = eps
        .iter()
        .filter(|e| e.addr != next.addr)
        .cloned()
        .collect();
    let d = r.route(facts("base", s), &rest, &mut ctx).unwrap();
    assert_eq!(d.session, Some(SessionOutcome::Moved));
    let third = d.pick.primary.addr;
    drop(d);
    // Outside the subset hint: moved within the subset.
    let other: Vec<SocketAddr> = rest
        .iter()
        .map(|e| e.addr)
        .filter(|a| *a != third)
        .collect();
    let hinted = RequestFacts {
        subset: Some(&other),
        ..facts("base", s)
    };
    let d = r.route(hinted, &eps, &mut ctx).unwrap();
    assert_eq!(
        (d.session, d.pick.primary.addr),
        (Some(SessionOutcome::Moved), other[0])
    );
    drop(d);
    // A preview reports without binding.
    let p = r.preview(facts("base", s), &eps, &mut ctx).unwrap();
    assert_eq!(
        (p.session, p.pick.primary.addr),
        (Some(SessionOutcome::Hit), other[0])
    );
    let told = heard.0.lock().clone();
    assert_eq!(
        told.len(),
        7,
        "every booked decision with a session: {told:?}"
    );
    assert!(told.iter().all(|(k, _)| Some(*k) == s));
    assert_eq!(
        told.last().map(|t| t.1.worker),
        Some(worker_id(&other[0].to_string()))
    );
}

#[test]
fn a_peer_binding_is_followed() {
    let r = kv_router(Saturation::in_flight(0), AdapterAffinity::default());
    let eps = vec![ep(1, 0), ep(2, 5)];
    let key = SessionKey::of("from-a-peer");
    r.bind_peer_session(key, eps[1].rank(), Instant::now(), Duration::from_secs(1));
    let d = r
        .route(facts("base", Some(key)), &eps, &mut PickContext::seeded(1))
        .unwrap();
    assert_eq!(
        (d.session, d.pick.primary.addr),
        (Some(SessionOutcome::Hit), eps[1].addr)
    );
    // Older than the time to live: forgotten.
    let stale = SessionKey::of("stale");
    r.bind_peer_session(
        stale,
        eps[1].rank(),
        Instant::now(),
        Duration::from_secs(601),
    );
    let d = r
        .route(
            facts("base", Some(stale)),
            &eps,
            &mut PickContext::seeded(1),
        )
        .unwrap();
    assert_eq!(
        (d.session, d.pick.primary.addr),
        (Some(SessionOutcome::New), eps[0].addr)
    );
}
