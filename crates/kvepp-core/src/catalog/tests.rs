use super::*;
use crate::hash::{local_block_hashes, sequence_hashes, LocalBlockHash};
use crate::index::{EngineBlockHash, Tier};

fn scope(model: &str) -> Scope {
    Scope {
        model: model.into(),
        tenant: "default".into(),
    }
}

fn worker(id: u64, block_size: u32, dp_start: u32, dp_size: u32) -> Worker {
    Worker {
        worker_id: id,
        block_size,
        dp_start,
        dp_size,
        endpoint: Some(format!("http://w{id}:8000")),
        kv_events_endpoints: BTreeMap::new(),
        replay_endpoint: None,
    }
}

fn catalog() -> Catalog {
    let mut c = Catalog::new(KvSettings::default(), Limits::default());
    c.register(scope("m"), worker(1, 16, 0, 2)).unwrap();
    c.register(scope("m"), worker(2, 16, 0, 1)).unwrap();
    c
}

/// Stores `n` blocks of `tokens` on a rank as an engine would publish them.
fn store(c: &Catalog, rank: WorkerRank, locals: &[LocalBlockHash]) {
    let t = c.tracker(&scope("m")).unwrap();
    let blocks = sequence_hashes(locals)
        .into_iter()
        .zip(locals.iter().copied())
        .map(|(s, l)| (EngineBlockHash(s.0), l));
    let blocks: Vec<_> = blocks.collect();
    t.kv.index()
        .write(|ix| ix.store(rank, Tier::Device, None, blocks.iter().copied()))
        .unwrap();
}

#[test]
fn registration_is_validated() {
    let mut c = catalog();
    assert_eq!(
        c.register(scope("m"), worker(3, 32, 0, 1)),
        Err(CatalogError::BlockSizeMismatch {
            model: "m".into(),
            tenant: "default".into(),
            have: 16,
            got: 32
        })
    );
    assert_eq!(
        c.register(scope("x"), worker(3, 0, 0, 1)),
        Err(CatalogError::ZeroBlockSize)
    );
    assert_eq!(
        c.register(scope("x"), worker(3, 16, 0, 0)),
        Err(CatalogError::ZeroDpSize)
    );
    assert_eq!(
        c.register(scope("x"), worker(3, 16, u32::MAX, 2)),
        Err(CatalogError::DpRangeOverflow {
            start: u32::MAX,
            size: 2
        })
    );
    // Another scope may use another block size; worker ids are per scope.
    c.register(scope("x"), worker(1, 32, 0, 1)).unwrap();
    assert_eq!(c.worker_count(), 3);
    assert_eq!(c.scopes_of(1).len(), 2);
    c.unregister(&scope("x"), 1).unwrap();
    assert!(c.tracker(&scope("x")).is_err(), "empty scope is gone");
    assert_eq!(
        c.unregister(&scope("x"), 1),
        Err(CatalogError::UnknownWorker(1))
    );
}

#[test]
fn select_follows_the_index_and_reports_per_rank_overlap() {
    let c = catalog();
    let tokens: Vec<u32> = (0..64).collect();
    let locals = local_block_hashes(&tokens, 16, None);
    let hashes = sequence_hashes(&locals);
    let on = WorkerRank {
        worker: 1,
        dp_rank: 1,
    };
    store(&c, on, &locals[..3]);
    let mut rng = fastrand::Rng::with_seed(1);
    let prompt = PromptRef {
        hashes: &hashes,
        isl_tokens: 64,
    };
    let s = c.select(&scope("m"), prompt, None, &mut rng).unwrap();
    assert_eq!(s.choice.rank, on);
    assert_eq!(s.choice.overlap.device, 3);
    assert_eq!(s.choice.effective_prefill_tokens, 64 - 48);
    assert_eq!(s.per_rank.get(&0).map(|o| o.device), Some(0));
    assert_eq!(s.per_rank.get(&1).map(|o| o.device), Some(3));
    assert_eq!(s.block_size, 16);
    assert_eq!(c.reservation_count(), 0, "select books nothing");
    assert!(matches!(
        c.select(&scope("nope"), prompt, None, &mut rng),
        Err(CatalogError::UnknownScope { .. })
    ));
}

#[test]
fn select_and_reserve_books_atomically_and_lifecycle_releases() {
    let c = catalog();
    let hashes: Vec<SequenceHash> = (1..=4).map(SequenceHash).collect();
    let prompt = PromptRef {
        hashes: &hashes,
        isl_tokens: 64,
    };
    let mut rng = fastrand::Rng::with_seed(2);
    let now = Instant::now();
    let mut chosen = Vec::new();
    // Three ranks, three reservations of the same prompt: each lands on an idle rank.
    for id in ["a", "b", "c"] {
        let s = c
            .select(&scope("m"), prompt, Some((id, now)), &mut rng)
            .unwrap();
        chosen.push(s.choice.rank);
    }
    chosen.sort();
    chosen.dedup();
    assert_eq!(chosen.len(), 3, "load spreads: {chosen:?}");
    assert_eq!(
        c.select(&scope("m"), prompt, Some(("a", now)), &mut rng),
        Err(CatalogError::DuplicateReservation("a".into()))
    );
    let t = c.tracker(&scope("m")).unwrap();
    let total = |c: &Catalog| -> u64 {
        c.loads(t)
            .iter()
            .map(|(_, l)| l.active_prefill_tokens)
            .sum()
    };
    assert_eq!(total(&c), 3 * 64);
    c.prefill_complete("a").unwrap();
    assert_eq!(total(&c), 2 * 64);
    c.output_block("b", Some(0.5)).unwrap();
    assert!(c.free("a"));
    assert!(!c.free("a"));
    assert_eq!(
        c.prefill_complete("a"),
        Err(CatalogError::UnknownReservation("a".into()))
    );
    assert_eq!(c.reservation_count(), 2);
}

#[test]
fn explicit_reservations_are_checked() {
    let mut c = catalog();
    let hashes = [SequenceHash(9)];
    let prompt = PromptRef {
        hashes: &hashes,
        isl_tokens: 16,
    };
    let now = Instant::now();
    let r = |worker, dp_rank| WorkerRank { worker, dp_rank };
    assert_eq!(
        c.reserve(&scope("m"), "x", r(1, 0), prompt, Some(17), now),
        Err(CatalogError::EffectiveAboveInput {
            effective: 17,
            isl: 16
        })
    );
    assert_eq!(
        c.reserve(&scope("m"), "x", r(2, 1), prompt, None, now),
        Err(CatalogError::UnknownRank {
            worker: 2,
            dp_rank: 1
        })
    );
    assert_eq!(
        c.reserve(&scope("m"), "x", r(9, 0), prompt, None, now),
        Err(CatalogError::UnknownWorker(9))
    );
    c.reserve(&scope("m"), "x", r(1, 1), prompt, Some(4), now)
        .unwrap();
    let t = c.tracker(&scope("m")).unwrap();
    assert!(c.loads(t).contains(&(
        r(1, 1),
        RankLoad {
            active_requests: 1,
            active_prefill_tokens: 4,
            active_decode_blocks: 1
        }
    )));
    // Unregistering the worker drops its reservation.
    c.unregister(&scope("m"), 1).unwrap();
    assert!(!c.free("x"));
    // Scoped ids (slot tracker): the same id in two scopes is two requests.
    c.register(scope("y"), worker(5, 16, 0, 1)).unwrap();
    c.add_scoped(&scope("m"), "q", r(2, 0), &hashes, 0, now)
        .unwrap();
    c.add_scoped(&scope("y"), "q", r(5, 0), &hashes, 0, now)
        .unwrap();
    assert_eq!(
        c.add_scoped(&scope("y"), "q", r(5, 0), &hashes, 0, now),
        Err(CatalogError::DuplicateReservation("q".into()))
    );
    // Stale requests expire.
    assert_eq!(
        c.expire(now + crate::slots::STALE_REQUEST_AFTER + std::time::Duration::from_secs(1)),
        2
    );
}

#[test]
fn pooled_catalog_shares_the_pickers_state() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let router = Arc::new(Router::kv_aware(kv.clone(), Saturation::in_flight(0)));
    let mut c = Catalog::pooled(router, Limits::default()).unwrap();
    assert_eq!(
        c.register(scope("m"), worker(1, 16, 0, 1)),
        Err(CatalogError::Pooled)
    );
    let rank = WorkerRank {
        worker: 7,
        dp_rank: 0,
    };
    c.set_pool(vec![Arc::new(Endpoint::for_rank(rank, "w7"))]);
    let hashes = [SequenceHash(1)];
    let prompt = PromptRef {
        hashes: &hashes,
        isl_tokens: 10,
    };
    let mut rng = fastrand::Rng::new();
    let s = c
        .select(
            &scope("any-model"),
            prompt,
            Some(("r", Instant::now())),
            &mut rng,
        )
        .unwrap();
    assert_eq!(s.choice.rank.worker, 7);
    assert_eq!(kv.active_count(), 1, "booked in the picker's own tracker");
}

#[test]
fn a_reservation_expired_by_the_routers_upkeep_gives_its_booking_back() {
    let kv = Arc::new(KvState::new(KvSettings::default()));
    let router = Arc::new(Router::kv_aware(kv.clone(), Saturation::in_flight(0)));
    let mut c = Catalog::pooled(router.clone(), Limits::default()).unwrap();
    let rank = WorkerRank {
        worker: 7,
        dp_rank: 0,
    };
    let ep = Arc::new(Endpoint::for_rank(rank, "w7"));
    c.set_pool(vec![ep.clone()]);
    let t0 = Instant::now();
    let hashes = [SequenceHash(1)];
    let prompt = PromptRef {
        hashes: &hashes,
        isl_tokens: 10,
    };
    let mut rng = fastrand::Rng::with_seed(1);
    c.select(&scope("m"), prompt, Some(("r", t0)), &mut rng)
        .unwrap();
    assert_eq!(ep.load.in_flight(), 1, "the reservation holds its booking");
    // The router's upkeep (not the catalog) drops the stale request from the shared tracker.
    let later = t0 + crate::slots::STALE_REQUEST_AFTER + std::time::Duration::from_secs(1);
    assert_eq!(router.maintain(later), 1);
    c.expire(later);
    assert_eq!(ep.load.in_flight(), 0, "the booking was given back");
    assert_eq!(c.reservation_count(), 0);
    assert!(!c.free("r"), "nothing left to free");
}

#[test]
fn scopes_keep_sessions_as_the_catalog_is_told() {
    use crate::affinity::{SessionAffinity, SessionKey, SessionOutcome};
    let mut c =
        Catalog::new(KvSettings::default(), Limits::default()).with_sessions(SessionAffinity {
            ttl_seconds: 1,
            ..SessionAffinity::default()
        });
    c.register(scope("m"), worker(1, 16, 0, 2)).unwrap();
    let hashes: Vec<SequenceHash> = (1..=4).map(SequenceHash).collect();
    let prompt = PromptRef {
        hashes: &hashes,
        isl_tokens: 64,
    };
    let mut rng = fastrand::Rng::with_seed(3);
    let s = Some(SessionKey::of("chat"));
    let t0 = Instant::now();
    let first = c
        .select_in_session(&scope("m"), prompt, s, Some(("r1", t0)), &mut rng)
        .unwrap();
    assert_eq!(first.session, Some(SessionOutcome::New));
    // The bound rank holds a reservation; the session still goes there within its second.
    let again = c
        .select_in_session(&scope("m"), prompt, s, Some(("r2", t0)), &mut rng)
        .unwrap();
    assert_eq!(
        (again.session, again.choice.rank),
        (Some(SessionOutcome::Hit), first.choice.rank)
    );
    // Two seconds later the binding has expired (ttl_seconds: 1).
    let later = t0 + std::time::Duration::from_secs(2);
    let expired = c
        .select_in_session(&scope("m"), prompt, s, Some(("r3", later)), &mut rng)
        .unwrap();
    assert_eq!(expired.session, Some(SessionOutcome::New));
}
