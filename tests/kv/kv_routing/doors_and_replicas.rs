//! The HTTP doors sharing state with Envoy's picks, and replicas sharing picks, releases and routed
//! prefixes.

use super::*;

/// `kvepp serve` with both HTTP doors open: they share the picker's state. A reservation booked
/// over HTTP steers Envoy's picks away from its worker, and a request Envoy routed shows in the
/// slot tracker's `GET /loads`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_doors_share_state_with_envoy_picks() {
    let (a, b, epp) = two_engines(|c| {
        c.select_service_port = Some(0);
        c.slot_tracker_port = Some(0);
    })
    .await;
    let select = epp.select_service.expect("select door");
    let slots = epp.slot_tracker.expect("slot tracker door");
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let json_req = |addr: SocketAddr,
                    method: &'static str,
                    path: String,
                    body: serde_json::Value| async move {
        http(
            addr,
            method,
            &path,
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    };

    // Discovered endpoints are the workers, with stable ids.
    let workers = wait_for("both endpoints listed as workers", || async {
        let v = json_req(select, "GET", "/workers".into(), serde_json::Value::Null)
            .await
            .json();
        (v.as_array()?.len() == 2).then_some(v)
    })
    .await;
    let id_of = |e: &Engine| {
        let endpoint = format!("http://{}", e.http);
        workers
            .as_array()
            .expect("list")
            .iter()
            .find(|w| w["endpoint"] == serde_json::json!(endpoint))
            .and_then(|w| w["worker_id"].as_u64())
            .expect("worker listed")
    };
    let (wa, wb) = (id_of(&a), id_of(&b));
    let again = json_req(select, "GET", "/workers".into(), serde_json::Value::Null)
        .await
        .json();
    assert_eq!(again, workers, "ids are stable");

    // A heavy reservation on one engine sends cold prompts to the other, both ways.
    for (busy, free, name) in [(wa, "b", "a"), (wb, "a", "b")] {
        let hashes: Vec<u64> = (0..256).map(|i| u64::from(busy as u32) + i).collect();
        let r = json_req(
            select,
            "POST",
            "/reservations".into(),
            serde_json::json!({"reservation_id": format!("heavy-{name}"), "worker_id": busy,
                               "dp_rank": 0, "sequence_hashes": hashes, "isl_tokens": 4096}),
        )
        .await;
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
        for k in 0..3 {
            assert_eq!(
                served_by(
                    &envoy,
                    &tokens(40 + k + u32::from(free == "a") * 10, 4 * BLOCK)
                )
                .await,
                free,
                "cold prompt {k} while {name} carries an HTTP reservation"
            );
        }
        let r = json_req(
            select,
            "DELETE",
            format!("/reservations/heavy-{name}"),
            serde_json::Value::Null,
        )
        .await;
        assert_eq!(r.status, 200);
    }

    // An Envoy pick shows in the slot tracker's loads while its stream runs.
    let held = tokens(60, 4 * BLOCK);
    let mut stream = TcpStreamRequest::start(envoy.addr, prompt(&held, true)).await;
    let first = stream.first_chunk().await;
    let (engine, worker) = if first.contains("\"engine\":\"a\"") {
        (&a, wa)
    } else {
        (&b, wb)
    };
    let loads = json_req(slots, "GET", "/loads".into(), serde_json::Value::Null)
        .await
        .json();
    let row = loads
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["worker_id"] == serde_json::json!(worker))
        .cloned()
        .expect("the picked worker's row");
    assert_eq!(row["active_decode_blocks"], serde_json::json!(4), "{loads}");
    engine.state.release.notify_one();
    assert_eq!(stream.rest().await, "done\n");
    wait_for("the Envoy pick released in /loads", || async {
        all_idle(
            &json_req(slots, "GET", "/loads".into(), serde_json::Value::Null)
                .await
                .json(),
        )
    })
    .await;
    // Workers come from discovery: the doors do not register any.
    let r = json_req(
        select,
        "POST",
        "/workers".into(),
        serde_json::json!({"worker_id": 5}),
    )
    .await;
    assert_eq!(r.status, 409);
    drop(envoy);
    epp.stop().await;
}

/// Two kvepp replicas with replica sync on, each behind its own Envoy, over the same two engines;
/// each opens its slot-tracker door (which shows its loads).
pub(super) async fn two_replicas(picker: kvepp::config::PickerKind) -> (Engine, Engine, Epp, Epp) {
    two_replicas_with(picker, true).await
}

/// [`two_replicas`], with the slot-tracker door or without any HTTP door (`doors`).
pub(super) async fn two_replicas_with(
    picker: kvepp::config::PickerKind,
    doors: bool,
) -> (Engine, Engine, Epp, Epp) {
    let (a, b, m, events_port) = engine_pair().await;
    let (p1, p2) = (free_port(), free_port());
    let replica = |own: u16, peer: u16, picker| {
        move |c: &mut kvepp::config::Config| {
            c.kv_events.enabled = true;
            c.kv_events.port = events_port;
            c.block_size = Some(BLOCK as u32);
            c.picker = picker;
            c.slot_tracker_port = doors.then_some(0);
            c.replica_sync.bind = Some(format!("tcp://127.0.0.1:{own}"));
            c.replica_sync.advertise = Some(format!("tcp://127.0.0.1:{own}"));
            c.replica_sync.peers = vec![format!("tcp://127.0.0.1:{peer}")];
        }
    };
    let one = Epp::start(&m, replica(p1, p2, picker)).await;
    let two = Epp::start(&m, replica(p2, p1, picker)).await;
    (a, b, one, two)
}

pub(super) async fn applied(epp: &Epp) -> f64 {
    epp.metric("kvepp_replica_sync_events_total{outcome=\"applied\"}")
        .await
        .unwrap_or(0.0)
}

/// Sends prompts through `envoy` until `other` has applied replica events (ZMQ subscriptions
/// take a moment; events before that are lost, as documented), then until it is quiet.
pub(super) async fn until_replicas_synced(envoy: &Envoy, other: &Epp) {
    let mut k = 0;
    wait_for("replica events applied on the other replica", || {
        k += 1;
        async move {
            served_by(envoy, &tokens(900 + k, BLOCK)).await;
            (applied(other).await > 0.0).then_some(())
        }
    })
    .await;
    wait_for("the other replica's loads back to idle", || async {
        all_idle(
            &http(other.slot_tracker?, "GET", "/loads", &[], "")
                .await
                .json(),
        )
    })
    .await;
}

/// Active-active: a stream held through replica one weighs on replica two's picks, so two replicas
/// balance like one (no leader election).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_picks_and_releases() {
    let (a, b, one, two) = two_replicas(kvepp::config::PickerKind::KvAware).await;
    until_engines_publish(&one, &[&a, &b]).await;
    until_engines_publish(&two, &[&a, &b]).await;
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    let envoy2 = Envoy::start(bootstrap(), two.grpc).await;
    until_replicas_synced(&envoy1, &two).await;

    let held = tokens(70, 4 * BLOCK);
    let mut stream = TcpStreamRequest::start(envoy1.addr, prompt(&held, true)).await;
    let first = stream.first_chunk().await;
    let (engine, name, other) = if first.contains("\"engine\":\"a\"") {
        (&a, "a", "b")
    } else {
        (&b, "b", "a")
    };
    let id = kvepp_core::kv::worker_id(&engine.http.to_string());
    let slots2 = two.slot_tracker.expect("door");
    wait_for("replica one's pick in replica two's loads", || async {
        let v = http(slots2, "GET", "/loads", &[], "").await.json();
        v.as_array()?
            .iter()
            .any(|r| {
                r["worker_id"] == serde_json::json!(id)
                    && r["active_decode_blocks"] == serde_json::json!(4)
            })
            .then_some(())
    })
    .await;
    for k in 0..3 {
        assert_eq!(
            served_by(&envoy2, &tokens(80 + k, 4 * BLOCK)).await,
            other,
            "cold prompt {k} through replica two while replica one streams on {name}"
        );
    }
    engine.state.release.notify_one();
    assert_eq!(stream.rest().await, "done\n");
    wait_for("the release reaches replica two", || async {
        all_idle(&http(slots2, "GET", "/loads", &[], "").await.json())
    })
    .await;
    drop((envoy1, envoy2));
    one.stop().await;
    two.stop().await;
}

/// Approximate prefix routing: the prefix replica one routed is known to replica two, so the next
/// turn of the conversation keeps its affinity whichever replica takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_routed_prefixes_in_approximate_mode() {
    let (a, b, one, two) = two_replicas(kvepp::config::PickerKind::ApproximatePrefix).await;
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    let envoy2 = Envoy::start(bootstrap(), two.grpc).await;
    until_replicas_synced(&envoy1, &two).await;
    for turn in 0..3u32 {
        let first = tokens(100 + turn, 6 * BLOCK);
        let before = applied(&two).await;
        let holder = served_by(&envoy1, &first).await;
        // Routed prefix, admission, prefill completion and free: four events.
        wait_for(
            "replica one's routed prefix applied on replica two",
            || async { (applied(&two).await >= before + 4.0).then_some(()) },
        )
        .await;
        let mut next = first.clone();
        next.extend(tokens(200 + turn, 2 * BLOCK));
        assert_eq!(
            served_by(&envoy2, &next).await,
            holder,
            "turn {turn}: replica two keeps the conversation on the engine replica one chose"
        );
    }
    drop((a, b, envoy1, envoy2));
    one.stop().await;
    two.stop().await;
}

/// On Kubernetes the replicas' peers are the endpoints of kvepp's own Service: two replicas on
/// 127.0.0.4 and 127.0.0.5, one EndpointSlice listing both, no peer configured by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_find_each_other_through_their_own_service() {
    let events_port = free_port();
    let a = Engine::start("a", [127, 0, 0, 2].into(), events_port).await;
    let b = Engine::start("b", [127, 0, 0, 3].into(), events_port).await;
    let port = free_port();
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a.http, true);
    m += &slice_yaml("b", b.http, true);
    m += &format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: kvepp-x, labels: {{kubernetes.io/service-name: kvepp}}}}\naddressType: IPv4\nendpoints:\n- addresses: [\"127.0.0.4\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: kvepp-1}}\n- addresses: [\"127.0.0.5\"]\n  conditions: {{ready: true}}\n  targetRef: {{kind: Pod, name: kvepp-2}}\nports: [{{name: replica-sync, port: {port}}}]\n"
    );
    let replica = |ip: &'static str| {
        move |c: &mut kvepp::config::Config| {
            c.kv_events.enabled = true;
            c.kv_events.port = events_port;
            c.block_size = Some(BLOCK as u32);
            c.slot_tracker_port = Some(0);
            c.replica_sync.bind = Some(format!("tcp://{ip}:{port}"));
            c.replica_sync.advertise = Some(format!("tcp://{ip}:{port}"));
            c.replica_sync.peers_service = Some("kvepp".into());
        }
    };
    let one = Epp::start(&m, replica("127.0.0.4")).await;
    let two = Epp::start(&m, replica("127.0.0.5")).await;
    for (epp, other) in [(&one, "127.0.0.5"), (&two, "127.0.0.4")] {
        let slots = epp.slot_tracker.expect("door");
        let want = serde_json::json!([format!("tcp://{other}:{port}")]);
        wait_for("the other replica as the only peer", || {
            let want = want.clone();
            async move { (http(slots, "GET", "/peers", &[], "").await.json() == want).then_some(()) }
        })
        .await;
    }
    let envoy1 = Envoy::start(bootstrap(), one.grpc).await;
    until_replicas_synced(&envoy1, &two).await;
    drop(envoy1);
    one.stop().await;
    two.stop().await;
}

/// A (re)started `kvepp serve` replica recovers the KV index from a peer's `/dump` before it serves:
/// before any KV event of its own, it holds what the peer learned from the engines, and keeps it
/// once its own subscriptions start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_replica_recovers_the_index_from_a_peer() {
    let (a, b, m, events_port) = engine_pair().await;
    let one = Epp::start(&m, |c| subscribed(c, events_port)).await;
    until_engines_publish(&one, &[&a, &b]).await;
    let envoy = Envoy::start(bootstrap(), one.grpc).await;
    served_by(&envoy, &tokens(300, 4 * BLOCK)).await;
    served_by(&envoy, &tokens(301, 6 * BLOCK)).await;
    wait_for("both prompts in replica one's index", || async {
        (one.metric("kvepp_kv_event_blocks_stored_total").await? >= 10.0).then_some(())
    })
    .await;
    let peer = format!("http://{}", one.metrics);
    let two = Epp::start(&m, |c| {
        subscribed(c, events_port);
        c.replica_sync.indexer_peers = vec!["http://127.0.0.1:1".into(), peer];
    })
    .await;
    // The recovery's own account: one dump applied (the unusable peer skipped), ten pairs.
    assert_eq!(
        recovery_metrics(&two).await,
        [Some(1.0), None, Some(10.0)],
        "replica two's recovery metrics"
    );
    let recovered = kv_index(&two).await;
    assert_eq!(
        recovered,
        kv_index(&one).await,
        "the same index, first unusable peer skipped"
    );
    let blocks: usize = recovered["endpoints"]
        .as_object()
        .unwrap()
        .values()
        .map(|e| e["blocks"].as_array().unwrap().len())
        .sum();
    assert_eq!(blocks, 10);
    // Replica two's own subscriptions join engines long past their first batches, with no replay
    // socket: that opening gap must not void what the peer's dump gave it.
    until_engines_publish(&two, &[&a, &b]).await;
    assert_eq!(
        kv_index(&two).await,
        kv_index(&one).await,
        "the recovered index outlives the subscriptions' opening gap"
    );
    drop(envoy);
    one.stop().await;
    two.stop().await;
}

/// A replica none of whose indexer peers is usable starts anyway, with an empty index, and says
/// so in its metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_a_usable_peer_starts_empty_and_counts_it() {
    let (a, b, m, _) = engine_pair().await;
    let epp = Epp::start(&m, |c| {
        c.block_size = Some(BLOCK as u32);
        c.replica_sync.indexer_peers = vec!["http://127.0.0.1:1".into()];
    })
    .await;
    assert_eq!(recovery_metrics(&epp).await, [None, Some(1.0), Some(0.0)]);
    let index = kv_index(&epp).await;
    for e in [&a, &b] {
        assert_eq!(
            index["endpoints"][e.http.to_string()]["blocks"],
            serde_json::json!([])
        );
    }
    epp.stop().await;
}

/// A replica's recoveries that applied a dump, those that found no usable peer, and the pairs
/// restored.
async fn recovery_metrics(epp: &Epp) -> [Option<f64>; 3] {
    [
        epp.metric("kvepp_index_recoveries_total{result=\"recovered\"}")
            .await,
        epp.metric("kvepp_index_recoveries_total{result=\"failed\"}")
            .await,
        epp.metric("kvepp_index_recovered_pairs").await,
    ]
}

async fn picks(epp: &Epp) -> f64 {
    epp.metric("kvepp_kv_prefix_mode_total{mode=\"token_ids\"}")
        .await
        .unwrap_or(0.0)
}

/// Two replicas behind one Envoy, which spreads ext_proc streams over both: each replica's loads
/// count every running request, its own and the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_behind_one_envoy_each_see_the_total_load() {
    let (a, b, one, two) = two_replicas(kvepp::config::PickerKind::KvAware).await;
    until_engines_publish(&one, &[&a, &b]).await;
    until_engines_publish(&two, &[&a, &b]).await;
    // Warm both directions with one Envoy per replica, then one Envoy over both.
    for (from, to) in [(&one, &two), (&two, &one)] {
        let e = Envoy::start(bootstrap(), from.grpc).await;
        until_replicas_synced(&e, to).await;
    }
    let mut both = bootstrap();
    for c in both["static_resources"]["clusters"]
        .as_sequence_mut()
        .expect("clusters")
        .iter_mut()
        .filter(|c| c["name"] == "kvepp")
    {
        let eps = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_sequence_mut()
            .expect("lb_endpoints");
        let mut second = eps[0].clone();
        let sa = &mut second["endpoint"]["address"]["socket_address"];
        sa["address"] = two.grpc.ip().to_string().into();
        sa["port_value"] = two.grpc.port().into();
        eps.push(second);
    }
    let envoy = Envoy::start(both, one.grpc).await;
    let (before1, before2) = (picks(&one).await, picks(&two).await);
    let mut streams = Vec::new();
    for k in 0..4 {
        let mut s =
            TcpStreamRequest::start(envoy.addr, prompt(&tokens(500 + k, 4 * BLOCK), true)).await;
        let first = s.first_chunk().await;
        let engine = if first.contains("\"engine\":\"a\"") {
            &a
        } else {
            &b
        };
        streams.push((s, engine));
    }
    assert!(
        picks(&one).await > before1 && picks(&two).await > before2,
        "Envoy used both replicas"
    );
    for epp in [&one, &two] {
        let slots = epp.slot_tracker.expect("door");
        wait_for("every running request in this replica's loads", || async {
            let v = http(slots, "GET", "/loads", &[], "").await.json();
            let total: u64 = v
                .as_array()?
                .iter()
                .map(|r| r["active_decode_blocks"].as_u64().unwrap_or(0))
                .sum();
            (total == 16).then_some(())
        })
        .await;
    }
    for (s, engine) in streams {
        engine.state.release.notify_one();
        assert_eq!(s.rest().await, "done\n");
    }
    for epp in [&one, &two] {
        let slots = epp.slot_tracker.expect("door");
        wait_for("all released on this replica", || async {
            all_idle(&http(slots, "GET", "/loads", &[], "").await.json())
        })
        .await;
    }
    drop(envoy);
    one.stop().await;
    two.stop().await;
}
