//! Disaggregated picks through the router: one test per row of the topology design's runtime
//! table and backward-compatibility list, the prefill pre-filter, the soft preference, and the
//! two bookings.

use super::*;
use crate::disagg::{MismatchPolicy, Role, TransferSettings};
use crate::kv::KvSettings;

/// An endpoint with a role and topology (`zone`, `host`; None: the worker lacks the level).
fn w(port: u16, role: Role, zone: Option<&str>, host: &str) -> Arc<Endpoint> {
    let mut e = Endpoint::new(([127, 0, 0, 1], port).into(), format!("pod-{port}"));
    e.role = role;
    if let Some(z) = zone {
        e.domains.insert("zone".into(), z.into());
    }
    e.domains.insert("host".into(), host.into());
    Arc::new(e)
}

fn router(settings: TransferSettings) -> Router {
    let kv = Arc::new(KvState::new(KvSettings {
        block_size: 4,
        approx_bytes_per_token: 1,
        approximate_only: true,
        ..KvSettings::default()
    }));
    Router::kv_aware(kv, Saturation::in_flight(0)).with_disaggregation(settings)
}

fn zone_level(policy: MismatchPolicy) -> TransferSettings {
    TransferSettings {
        kv_transfer_topology_level: Some("zone".into()),
        kv_transfer_mismatch_policy: policy,
        ..TransferSettings::default()
    }
}

const PROMPT: &[u8] = b"a prompt long enough to fill several blocks of four bytes each";

fn facts() -> RequestFacts<'static> {
    RequestFacts {
        model: Some("m"),
        prompt: Prompt::Text {
            scope: "m",
            bytes: PROMPT,
        },
        ..RequestFacts::default()
    }
}

/// Routes `n` requests (keeping their bookings, so load moves the picks around); returns the
/// (prefill, decode) ports of each.
fn pairs(r: &Router, eps: &[Arc<Endpoint>], n: usize) -> Vec<(Option<u16>, u16)> {
    let mut ctx = PickContext::seeded(7);
    let mut held = Vec::new();
    let mut out = Vec::new();
    for _ in 0..n {
        let d = r.route(facts(), eps, &mut ctx).unwrap();
        out.push((
            d.pick.pairing.as_ref().map(|p| p.prefill.addr.port()),
            d.pick.primary.addr.port(),
        ));
        held.push(d.booking);
    }
    out
}

fn two_zones() -> Vec<Arc<Endpoint>> {
    vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(2, Role::Prefill, Some("b"), "h2"),
        w(11, Role::Decode, Some("a"), "h3"),
        w(12, Role::Decode, Some("a"), "h4"),
        w(21, Role::Decode, Some("b"), "h5"),
    ]
}

fn zone_of(port: u16) -> char {
    if port == 1 || (11..20).contains(&port) {
        'a'
    } else {
        'b'
    }
}

#[test]
fn level_unset_filters_nothing() {
    let r = router(TransferSettings::default());
    let got = pairs(&r, &two_zones(), 40);
    assert!(got.iter().all(|(p, _)| p.is_some()), "every pick pairs");
    let crossed = got
        .iter()
        .filter(|(p, d)| p.map(zone_of) != Some(zone_of(*d)))
        .count();
    assert!(crossed > 0, "without a level, load alone decides: {got:?}");
}

#[test]
fn same_domain_decode_workers_only() {
    for policy in [MismatchPolicy::Fail, MismatchPolicy::Fallback] {
        let r = router(zone_level(policy));
        let got = pairs(&r, &two_zones(), 60);
        for (p, d) in &got {
            assert_eq!(p.map(zone_of), Some(zone_of(*d)), "{policy:?}: {got:?}");
        }
        // Both zones' prefill workers were used (load spreads them).
        assert!(got.iter().any(|(p, _)| *p == Some(1)) && got.iter().any(|(p, _)| *p == Some(2)));
    }
}

#[test]
fn no_same_domain_decode_fail_refuses_fallback_crosses() {
    // Prefill only in zone a, decode only in zone b.
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(21, Role::Decode, Some("b"), "h2"),
    ];
    let err = router(zone_level(MismatchPolicy::Fail))
        .route(facts(), &eps, &mut PickContext::seeded(1))
        .unwrap_err();
    assert_eq!(
        err,
        PickError::TopologyMismatch {
            level: "zone".into(),
            domain: Some("a".into()),
            prefill: "pod-1".into()
        }
    );
    assert!(err.to_string().contains("zone \"a\""), "{err}");
    let d = router(zone_level(MismatchPolicy::Fallback))
        .route(facts(), &eps, &mut PickContext::seeded(1))
        .unwrap();
    let p = d.pick.pairing.as_ref().unwrap();
    assert_eq!((p.prefill.addr.port(), d.pick.primary.addr.port()), (1, 21));
    assert!(p.crossed);
    assert_eq!(
        (p.prefill_domain.as_deref(), p.decode_domain.as_deref()),
        (Some("a"), Some("b"))
    );
}

#[test]
fn worker_missing_the_level() {
    // A decode worker without a zone: excluded while a same-domain one exists (whatever its
    // load), under both policies.
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(11, Role::Decode, Some("a"), "h2"),
        w(30, Role::Decode, None, "h3"),
    ];
    for policy in [MismatchPolicy::Fail, MismatchPolicy::Fallback] {
        let got = pairs(&router(zone_level(policy)), &eps, 20);
        assert!(got.iter().all(|&(_, d)| d == 11), "{policy:?}: {got:?}");
    }
    // Only the zoneless one: fail excludes it (an error), fallback lets it take the transfer.
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(30, Role::Decode, None, "h3"),
    ];
    assert!(matches!(
        router(zone_level(MismatchPolicy::Fail)).route(facts(), &eps, &mut PickContext::seeded(1)),
        Err(PickError::TopologyMismatch { .. })
    ));
    let d = router(zone_level(MismatchPolicy::Fallback))
        .route(facts(), &eps, &mut PickContext::seeded(1))
        .unwrap();
    assert_eq!(d.pick.primary.addr.port(), 30);
    assert!(d.pick.pairing.unwrap().crossed);
    // A prefill worker without the level has no domain to match.
    let eps = vec![
        w(1, Role::Prefill, None, "h1"),
        w(11, Role::Decode, Some("a"), "h2"),
    ];
    let err = router(zone_level(MismatchPolicy::Fail))
        .route(facts(), &eps, &mut PickContext::seeded(1))
        .unwrap_err();
    assert!(
        matches!(&err, PickError::TopologyMismatch { domain: None, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("no such topology domain"), "{err}");
}

#[test]
fn prefill_workers_with_a_decode_peer_come_first() {
    // The zone-b prefill worker is far busier, but only zone b has a decode worker.
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(2, Role::Prefill, Some("b"), "h2"),
        w(21, Role::Decode, Some("b"), "h3"),
    ];
    let busy: Vec<_> = (0..20).map(|_| eps[1].load.book()).collect();
    for policy in [MismatchPolicy::Fail, MismatchPolicy::Fallback] {
        let got = pairs(&router(zone_level(policy)), &eps, 10);
        assert!(got.iter().all(|&(p, d)| (p, d) == (Some(2), 21)), "{got:?}");
    }
    drop(busy);
    // No prefill worker has a peer: all of them stay candidates (and the policy decides).
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(2, Role::Prefill, Some("c"), "h2"),
        w(21, Role::Decode, Some("b"), "h3"),
    ];
    let got = pairs(&router(zone_level(MismatchPolicy::Fallback)), &eps, 20);
    assert!(got.iter().any(|(p, _)| *p == Some(1)) && got.iter().any(|(p, _)| *p == Some(2)));
}

/// The recorded sequence: 30 requests, every third one's booking released, so picks see load.
fn sequence(r: &Router, eps: &[Arc<Endpoint>]) -> Vec<(Option<u16>, u16, Option<u16>)> {
    let mut ctx = PickContext::seeded(42);
    let mut held = Vec::new();
    let mut out = Vec::new();
    for i in 0..30 {
        let text = format!("{i:03} request text shared by some {}", i % 4);
        let f = RequestFacts {
            model: Some("m"),
            prompt: Prompt::Text {
                scope: "m",
                bytes: text.as_bytes(),
            },
            ..RequestFacts::default()
        };
        let d = r.route(f, eps, &mut ctx).unwrap();
        out.push((
            d.pick.pairing.as_ref().map(|p| p.prefill.addr.port()),
            d.pick.primary.addr.port(),
            d.pick.fallback.as_ref().map(|f| f.addr.port()),
        ));
        if i % 3 != 0 {
            held.push(d.booking);
        }
    }
    out
}

#[test]
fn backward_compatible_without_topology() {
    // An aggregated pool: topology settings change nothing.
    let agg = || {
        vec![
            w(1, Role::Both, Some("a"), "h1"),
            w(2, Role::Both, Some("b"), "h2"),
            w(3, Role::Both, None, "h3"),
        ]
    };
    let configured = TransferSettings {
        kv_transfer_weight: 5.0,
        ..zone_level(MismatchPolicy::Fail)
    };
    let base = sequence(&router(TransferSettings::default()), &agg());
    assert_eq!(base, sequence(&router(configured), &agg()));
    assert!(base.iter().all(|(p, _, _)| p.is_none()));
    // A disaggregated pool in one zone: the level filters nothing, picks are identical.
    let one_zone = || {
        vec![
            w(1, Role::Prefill, Some("a"), "h1"),
            w(2, Role::Prefill, Some("a"), "h2"),
            w(11, Role::Decode, Some("a"), "h3"),
            w(12, Role::Decode, Some("a"), "h4"),
        ]
    };
    assert_eq!(
        sequence(&router(TransferSettings::default()), &one_zone()),
        sequence(&router(zone_level(MismatchPolicy::Fail)), &one_zone())
    );
}

#[test]
fn soft_preference_prefers_near_decode_workers_within_the_filter() {
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(11, Role::Decode, Some("a"), "h1"), // same host, busy
        w(12, Role::Decode, Some("a"), "h9"), // same zone, idle
        w(21, Role::Decode, Some("b"), "h8"), // other zone, idle
    ];
    let _busy = eps[1].load.book();
    let soft = |weight, level: Option<&str>| TransferSettings {
        kv_transfer_weight: weight,
        kv_transfer_topology_level: level.map(str::to_owned),
        kv_transfer_mismatch_policy: MismatchPolicy::Fail,
        ..TransferSettings::default()
    };
    // Off: the idle ones only (load decides).
    let off = pairs(&router(soft(0.0, None)), &eps, 1);
    assert_ne!(off[0].1, 11);
    // On: the same host wins despite its load (transfer ≫ one request of decode load).
    let on = pairs(&router(soft(10.0, None)), &eps, 1);
    assert_eq!(on[0], (Some(1), 11));
    // The hard filter removes zone b; the soft cost ranks the survivors.
    let d = router(soft(10.0, Some("zone")))
        .route(facts(), &eps, &mut PickContext::seeded(3))
        .unwrap();
    let p = d.pick.pairing.unwrap();
    assert_eq!(d.pick.primary.addr.port(), 11);
    assert!(
        p.transfer_ms > 0.0 && p.transfer_ms < 1.0,
        "{}",
        p.transfer_ms
    );
    // Transfer times grow with distance: host < zone < cross-zone.
    let s = TransferSettings::default();
    let bytes = 1e9;
    let t = |i: usize| s.transfer_ms(&eps[0], &eps[i], bytes);
    assert!(t(1) < t(2) && t(2) < t(3), "{} {} {}", t(1), t(2), t(3));
    assert_eq!(s.transfer_ms(&eps[0], &eps[0], bytes), 0.0);
}

#[test]
fn both_legs_are_booked_and_released() {
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(11, Role::Decode, Some("a"), "h2"),
    ];
    let r = router(zone_level(MismatchPolicy::Fail));
    let kv = r.kv().unwrap().clone();
    let mut d = r.route(facts(), &eps, &mut PickContext::seeded(1)).unwrap();
    assert_eq!((eps[0].load.in_flight(), eps[1].load.in_flight()), (1, 1));
    assert!(kv.load("127.0.0.1:1").unwrap().active_requests == 1);
    assert!(kv.load("127.0.0.1:11").unwrap().active_requests == 1);
    // Prefill load on the prefill worker, none on the decode worker.
    assert!(kv.load("127.0.0.1:1").unwrap().active_prefill_tokens > 0);
    assert_eq!(kv.load("127.0.0.1:11").unwrap().active_prefill_tokens, 0);
    assert!(d.booking.prefill_pending());
    d.booking.first_byte();
    assert!(!d.booking.prefill_pending());
    assert_eq!((eps[0].load.in_flight(), eps[1].load.in_flight()), (0, 1));
    assert_eq!(kv.load("127.0.0.1:1").unwrap().active_requests, 0);
    drop(d);
    assert_eq!(eps[1].load.in_flight(), 0);
    assert_eq!(kv.load("127.0.0.1:11").unwrap().active_requests, 0);
    // An abort before the first byte releases both.
    let d = r.route(facts(), &eps, &mut PickContext::seeded(2)).unwrap();
    drop(d);
    assert_eq!((eps[0].load.in_flight(), eps[1].load.in_flight()), (0, 0));
}

#[test]
fn short_prompts_and_pools_without_prefill_or_decode_workers() {
    let eps = two_zones();
    let r = router(TransferSettings {
        prefill_threshold_tokens: 1000,
        ..zone_level(MismatchPolicy::Fail)
    });
    let d = r.route(facts(), &eps, &mut PickContext::seeded(1)).unwrap();
    assert!(d.pick.pairing.is_none(), "short prompt: decode alone");
    assert_eq!(d.pick.primary.role, Role::Decode);
    assert!(
        d.pick.kv.unwrap().effective_prefill_tokens > 0,
        "the decode worker prefills"
    );
    let decode_only = vec![
        w(11, Role::Decode, Some("a"), "h1"),
        w(3, Role::Both, Some("b"), "h2"),
    ];
    let d = router(TransferSettings::default())
        .route(facts(), &decode_only, &mut PickContext::seeded(1))
        .unwrap();
    // The `both` worker may prefill for a decode worker, or serve alone.
    if let Some(p) = &d.pick.pairing {
        assert_eq!(p.prefill.addr.port(), 3);
    }
    let prefill_only = vec![w(1, Role::Prefill, Some("a"), "h1")];
    assert_eq!(
        router(TransferSettings::default())
            .route(facts(), &prefill_only, &mut PickContext::seeded(1))
            .unwrap_err(),
        PickError::NoDecodeEndpoints
    );
    // No prompt (decided at the headers): a decode worker, no pairing.
    let d = router(TransferSettings::default())
        .route(RequestFacts::default(), &eps, &mut PickContext::seeded(1))
        .unwrap();
    assert!(d.pick.pairing.is_none());
    assert_eq!(d.pick.primary.role, Role::Decode);
}

#[test]
fn capacity_of_a_disaggregated_pool_is_its_decode_workers() {
    let eps = vec![
        w(1, Role::Prefill, Some("a"), "h1"),
        w(11, Role::Decode, Some("a"), "h2"),
    ];
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let r = Router::kv_aware(kv, Saturation::in_flight(2));
    let now = std::time::Instant::now();
    assert!(r.has_capacity(&eps, now));
    let held: Vec<_> = (0..2).map(|_| eps[1].load.book()).collect();
    assert!(
        !r.has_capacity(&eps, now),
        "the prefill worker's room is not capacity"
    );
    drop(held);
    assert!(r.has_capacity(&eps, now));
}

#[test]
fn only_the_part_the_best_decode_worker_has_not_cached_decides_disaggregation() {
    let eps = two_zones();
    let r = router(TransferSettings {
        prefill_threshold_tokens: 8,
        ..zone_level(MismatchPolicy::Fail)
    });
    let mut ctx = PickContext::seeded(1);
    // The whole prompt is new: through a prefill worker, whose KV the decode worker receives.
    let first = r.route(facts(), &eps, &mut ctx).unwrap();
    assert!(
        first.pick.pairing.is_some(),
        "an uncached prompt is disaggregated"
    );
    let decoder = first.pick.primary.addr;
    drop(first);
    // The same prompt again: only its last partial block is uncached on that decode worker.
    let again = r.route(facts(), &eps, &mut ctx).unwrap();
    assert!(again.pick.pairing.is_none(), "a cached prompt is not");
    assert_eq!(again.pick.primary.addr, decoder);
    let kv = again.pick.kv.unwrap();
    assert!(kv.effective_prefill_tokens <= 8, "{kv:?}");
    assert!(kv.overlap.device > 0);
}
