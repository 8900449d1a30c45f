//! The selection service's routes, statuses and shapes, and `/select` answering from real KV
//! events.

use super::*;

fn worker(id: u64, ranks: u32) -> Value {
    json!({"worker_id": id, "model_name": "model", "tenant_id": "default",
           "endpoint": format!("http://worker-{id}:8000"), "block_size": 4,
           "data_parallel_start_rank": 0, "data_parallel_size": ranks})
}

/// The selection service's routes one by one, each case on a service of its own: health,
/// readiness and the worker registry first, then, with two workers registered (worker 1 with two
/// data-parallel ranks, worker 2 with one), every route's statuses and shapes.
mod select_service_routes_statuses_and_shapes {
    use super::*;

    /// A service with worker 1 (two ranks) and worker 2 (one rank) registered.
    async fn with_two_workers() -> Service {
        let s = select_service(&["--threads", "2"]).await;
        for (id, ranks) in [(1, 2), (2, 1)] {
            let (st, v) = json_call(s.addr, "POST", "/workers", worker(id, ranks)).await;
            assert_eq!(st, 201, "{v}");
        }
        s
    }

    /// A prompt of four blocks no worker holds.
    fn selection() -> Value {
        json!({"model_name": "model", "tenant_id": "default",
               "block_hashes": [11, 12, 13, 14], "sequence_hashes": [21, 22, 23, 24],
               "isl_tokens": 16})
    }

    /// Health, readiness without and with workers, and registering, listing and removing workers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_readiness_and_the_worker_registry() {
        let s = select_service(&["--threads", "2"]).await;
        let a = s.addr;
        assert_eq!(json_call(a, "GET", "/health", Value::Null).await.0, 200);
        let r = call(a, "GET", "/ready", Value::Null).await;
        assert_eq!(r.status, 503, "not ready without workers");
        let v = r.json();
        assert_eq!(
            (v["status"].as_str(), v["workers"].as_u64()),
            (Some("not_ready"), Some(0))
        );
        assert!(v["error"].is_string());

        let (st, v) = json_call(a, "POST", "/workers", worker(1, 2)).await;
        assert_eq!(st, 201, "{v}");
        assert_eq!(v["endpoint"], json!("http://worker-1:8000"));
        assert_eq!(json_call(a, "POST", "/workers", worker(2, 1)).await.0, 201);
        assert_eq!(json_call(a, "GET", "/ready", Value::Null).await.0, 200);
        let (_, v) = json_call(a, "GET", "/workers", Value::Null).await;
        assert_eq!(v.as_array().unwrap().len(), 2);
        assert_eq!(v[0]["data_parallel_size"], json!(2));
        // model_name and tenant_id default to "default".
        assert_eq!(
            json_call(
                a,
                "POST",
                "/workers",
                json!({"worker_id": 9, "block_size": 4})
            )
            .await
            .0,
            201
        );
        let (_, v) = json_call(a, "GET", "/workers?model_name=default", Value::Null).await;
        assert_eq!(v[0]["tenant_id"], json!("default"));
        assert_eq!(
            json_call(a, "DELETE", "/workers/9", Value::Null).await.0,
            200
        );
        assert_eq!(
            json_call(a, "DELETE", "/workers/9", Value::Null).await.0,
            404
        );
        let mut bad = worker(3, 1);
        bad["kv_events_endpoints"] = json!({"5": "tcp://x:1"});
        assert_eq!(
            json_call(a, "POST", "/workers", bad).await.0,
            400,
            "rank outside the range"
        );
        s.stop().await;
    }

    /// Zero overlap: the selected rank is in `dp` with 0; absent ids omitted; `/select` books nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn select_with_zero_overlap_books_nothing() {
        let s = with_two_workers().await;
        let a = s.addr;
        let sel = selection();
        let (st, v) = json_call(a, "POST", "/select", sel.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert!(
            v.get("selection_id").is_none() && v.get("reservation_id").is_none(),
            "{v}"
        );
        let rank = v["dp_rank"].as_u64().unwrap().to_string();
        assert_eq!(v["overlap"]["dp"], json!({ rank: 0 }));
        assert_eq!(
            (
                v["overlap"]["longest_matched"].as_u64(),
                v["overlap"]["gpu"].as_u64(),
                v["overlap"]["cpu"].as_u64(),
                v["overlap"]["disk"].as_u64()
            ),
            (Some(0), Some(0), Some(0), Some(0))
        );
        assert_eq!(v["effective_prefill_tokens"], json!(16));
        assert_eq!(v["block_size"], json!(4));
        assert_eq!(v["model_name"], json!("model"));
        let w = v["worker_id"].as_u64().unwrap();
        assert_eq!(v["endpoint"], json!(format!("http://worker-{w}:8000")));
        // /select books nothing.
        let (_, loads) = json_call(a, "GET", "/loads", Value::Null).await;
        assert!(loads
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["active_prefill_tokens"] == json!(0)));
        s.stop().await;
    }

    /// `/select_and_reserve`: ids echoed, each reservation on an idle rank, a duplicate id 409, an id generated when none is given.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn select_and_reserve_echoes_ids_and_spreads_reservations() {
        let s = with_two_workers().await;
        let a = s.addr;
        let sel = selection();
        // select_and_reserve: ids echoed; each reservation spreads to an idle rank.
        let mut seen = std::collections::BTreeSet::new();
        for i in 0..3 {
            let mut b = sel.clone();
            b["selection_id"] = json!(format!("select-{i}"));
            b["reservation_id"] = json!(format!("request-{i}"));
            let (st, v) = json_call(a, "POST", "/select_and_reserve", b).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["selection_id"], json!(format!("select-{i}")));
            assert_eq!(v["reservation_id"], json!(format!("request-{i}")));
            seen.insert((v["worker_id"].as_u64(), v["dp_rank"].as_u64()));
        }
        assert_eq!(seen.len(), 3, "three ranks, three reservations: {seen:?}");
        let mut dup = sel.clone();
        dup["reservation_id"] = json!("request-0");
        assert_eq!(
            json_call(a, "POST", "/select_and_reserve", dup).await.0,
            409
        );
        // A generated reservation id when none is given.
        let (_, v) = json_call(a, "POST", "/select_and_reserve", sel.clone()).await;
        let generated = v["reservation_id"]
            .as_str()
            .expect("generated id")
            .to_owned();
        assert_eq!(
            json_call(
                a,
                "DELETE",
                &format!("/reservations/{generated}"),
                Value::Null
            )
            .await
            .0,
            200
        );
        s.stop().await;
    }

    /// Explicit reservations (validated, 409 on a duplicate, 404 on an unknown rank) and their lifecycle: prefill complete, output blocks, release.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn explicit_reservations_and_their_lifecycle() {
        let s = with_two_workers().await;
        let a = s.addr;
        let res = |id: &str, eff: Value| {
            let mut b = json!({"reservation_id": id, "model_name": "model", "tenant_id": "default",
                               "worker_id": 2, "dp_rank": 0, "sequence_hashes": [21, 22, 23, 24],
                               "isl_tokens": 16});
            if !eff.is_null() {
                b["effective_prefill_tokens"] = eff;
            }
            b
        };
        let (st, v) = json_call(a, "POST", "/reservations", res("r-1", json!(17))).await;
        assert_eq!(st, 400, "effective above the input length: {v}");
        assert_eq!(
            json_call(a, "POST", "/reservations", res("r-1", json!(8)))
                .await
                .0,
            201
        );
        assert_eq!(
            json_call(a, "POST", "/reservations", res("r-1", json!(8)))
                .await
                .0,
            409
        );
        let mut other_rank = res("r-2", Value::Null);
        other_rank["dp_rank"] = json!(3);
        assert_eq!(
            json_call(a, "POST", "/reservations", other_rank).await.0,
            404
        );
        let (_, loads) = json_call(a, "GET", "/loads?model_name=model", Value::Null).await;
        let w2 = loads
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["worker_id"] == json!(2))
            .unwrap()
            .clone();
        let before = w2["active_prefill_tokens"].as_u64().unwrap();
        assert!(before >= 8, "{loads}");

        // Lifecycle.
        let p = |id: &str, what: &str| format!("/reservations/{id}/{what}");
        assert_eq!(
            json_call(a, "POST", &p("r-1", "prefill_complete"), Value::Null)
                .await
                .0,
            200
        );
        let (_, loads) = json_call(a, "GET", "/loads?model_name=model", Value::Null).await;
        let after = loads
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["worker_id"] == json!(2))
            .unwrap()["active_prefill_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(after, before - 8);
        assert_eq!(
            json_call(a, "POST", &p("r-1", "output_block"), Value::Null)
                .await
                .0,
            200,
            "no body"
        );
        assert_eq!(
            json_call(
                a,
                "POST",
                &p("r-1", "output_block"),
                json!({"decay_fraction": 0.5})
            )
            .await
            .0,
            200
        );
        assert_eq!(
            json_call(
                a,
                "POST",
                &p("r-1", "output_block"),
                json!({"decay_fraction": 1.5})
            )
            .await
            .0,
            400
        );
        assert_eq!(
            json_call(
                a,
                "POST",
                &p("r-1", "output_block"),
                json!({"decay_fraction": -0.1})
            )
            .await
            .0,
            400
        );
        assert_eq!(
            json_call(a, "POST", &p("ghost", "output_block"), Value::Null)
                .await
                .0,
            404
        );
        assert_eq!(
            json_call(a, "POST", &p("ghost", "prefill_complete"), Value::Null)
                .await
                .0,
            404
        );
        assert_eq!(
            json_call(a, "DELETE", "/reservations/r-1", Value::Null)
                .await
                .0,
            200
        );
        assert_eq!(
            json_call(a, "DELETE", "/reservations/r-1", Value::Null)
                .await
                .0,
            404
        );
        s.stop().await;
    }

    /// Inspection: `/potential_loads` and `/overlap_scores` one row per rank, `/dump`, 404 for a model no worker serves.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inspection_routes_answer_per_rank() {
        let s = with_two_workers().await;
        let a = s.addr;
        let prompt = json!({"model_name": "model", "sequence_hashes": [21, 22], "isl_tokens": 8});
        let (st, v) = json_call(a, "POST", "/potential_loads", prompt.clone()).await;
        assert_eq!(st, 200);
        assert_eq!(v.as_array().unwrap().len(), 3, "one row per rank: {v}");
        assert!(v[0]["potential_prefill_tokens"].as_u64().unwrap() >= 8);
        let (st, v) = json_call(a, "POST", "/overlap_scores", prompt).await;
        assert_eq!(st, 200);
        assert_eq!(v.as_array().unwrap().len(), 3);
        assert_eq!(
            v[0],
            json!({"worker_id": 1, "dp_rank": 0, "longest_matched": 0, "gpu": 0, "cpu": 0, "disk": 0})
        );
        let (st, v) = json_call(a, "GET", "/dump", Value::Null).await;
        assert_eq!(st, 200);
        assert_eq!(v["scopes"][0]["model_name"], json!("model"));
        let unknown = json!({"model_name": "nope", "sequence_hashes": []});
        assert_eq!(
            json_call(a, "POST", "/select", unknown.clone()).await.0,
            404
        );
        assert_eq!(
            json_call(a, "POST", "/potential_loads", unknown).await.0,
            404
        );
        s.stop().await;
    }

    /// PATCH updates supplied fields only: 404 for an unknown worker, 409 for a block-size change.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn patch_updates_supplied_fields_only() {
        let s = with_two_workers().await;
        let a = s.addr;
        let (st, v) = json_call(
            a,
            "PATCH",
            "/workers/2",
            json!({"endpoint": "http://moved:8000"}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            (v["endpoint"].as_str(), v["block_size"].as_u64()),
            (Some("http://moved:8000"), Some(4))
        );
        assert_eq!(
            json_call(a, "PATCH", "/workers/77", json!({"endpoint": "http://x:1"}))
                .await
                .0,
            404
        );
        assert_eq!(
            json_call(a, "PATCH", "/workers/2", json!({"block_size": 8}))
                .await
                .0,
            409
        );
        s.stop().await;
    }

    /// Replica-sync peers registered, listed and deregistered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn replica_sync_peers_register_and_deregister() {
        let s = with_two_workers().await;
        let a = s.addr;
        let peer = json!({"endpoint": "tcp://selector-b:9092"});
        assert_eq!(
            json_call(a, "POST", "/replica_sync/register_peer", peer.clone()).await,
            (200, json!({"status": "ok"}))
        );
        assert_eq!(
            json_call(a, "GET", "/replica_sync/peers", Value::Null)
                .await
                .1,
            json!(["tcp://selector-b:9092"])
        );
        assert_eq!(
            json_call(a, "POST", "/replica_sync/deregister_peer", peer)
                .await
                .0,
            200
        );
        assert_eq!(
            json_call(a, "GET", "/replica_sync/peers", Value::Null)
                .await
                .1,
            json!([])
        );
        s.stop().await;
    }

    /// Malformed JSON, oversized bodies, unknown routes and wrong methods: one error shape.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn errors_have_one_shape() {
        let s = with_two_workers().await;
        let a = s.addr;
        error_shapes(a, "/select", "/loads").await;
        s.stop().await;
    }
}

/// A registered worker's publisher (pyzmq, vLLM's framing) stores blocks; `/overlap_scores`,
/// `/select` and `/potential_loads` answer with the matching overlap for hashes computed by the
/// client (Dynamo's block hash: the golden vectors of tokens 1..=16 in blocks of 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_answers_from_real_kv_events() {
    let (port, replay) = (free_port(), free_port());
    let mut publisher = Publisher::start(port, replay, "vllm").await;
    let s = select_service(&[]).await;
    let a = s.addr;
    let mut w = worker(1, 1);
    w["kv_events_endpoints"] = json!({"0": format!("tcp://127.0.0.1:{port}")});
    w["replay_endpoint"] = json!(format!("tcp://127.0.0.1:{replay}"));
    assert_eq!(json_call(a, "POST", "/workers", w).await.0, 201);
    assert_eq!(json_call(a, "POST", "/workers", worker(2, 1)).await.0, 201);

    // The engine stores tokens 1..=16 as 4 blocks of 4 (vLLM's legacy BlockStored).
    let tokens: Vec<u32> = (1..=16).collect();
    let event = (
        "BlockStored",
        vec![1001u64, 1002, 1003, 1004],
        None::<u64>,
        tokens,
        4u32,
        None::<u32>,
        None::<String>,
    );
    let payload = rmp_serde::to_vec(&(1.0f64, vec![event])).unwrap();
    publisher.publish(0, &payload).await;

    // Dynamo's hashes of those blocks, sent as signed 64-bit integers.
    let seq: [u64; 4] = [
        0xcb38e4d7fb2dca5c,
        0x44a2b2379d6d3c3d,
        0xaea1e67a6c80cf84,
        0x1aaa5eb6e2524a3b,
    ];
    let local: [u64; 4] = [
        0xcb38e4d7fb2dca5c,
        0xe8d3ec39b907b74c,
        0x06b748f1777d599c,
        0x01e03482f18b34e9,
    ];
    let signed = |v: &[u64]| json!(v.iter().map(|h| *h as i64).collect::<Vec<_>>());
    let mut longer = seq.to_vec();
    longer.push(0x1234); // a fifth block nobody holds
    let prompt =
        json!({"model_name": "model", "sequence_hashes": signed(&longer), "isl_tokens": 20});
    let rows = wait_for("the publisher's blocks in the index", || {
        let prompt = prompt.clone();
        async move {
            let (_, v) = json_call(a, "POST", "/overlap_scores", prompt).await;
            let row = v
                .as_array()?
                .iter()
                .find(|r| r["worker_id"] == json!(1))?
                .clone();
            (row["gpu"] == json!(16)).then_some(v)
        }
    })
    .await;
    assert_eq!(
        rows,
        json!([
            {"worker_id": 1, "dp_rank": 0, "longest_matched": 16, "gpu": 16, "cpu": 16, "disk": 16},
            {"worker_id": 2, "dp_rank": 0, "longest_matched": 0, "gpu": 0, "cpu": 0, "disk": 0},
        ])
    );
    let sel = json!({"selection_id": "s", "model_name": "model", "block_hashes": signed(&local),
                     "sequence_hashes": signed(&seq), "isl_tokens": 20});
    let (st, v) = json_call(a, "POST", "/select", sel).await;
    assert_eq!(st, 200);
    assert_eq!(
        v["worker_id"],
        json!(1),
        "the worker holding the prefix: {v}"
    );
    assert_eq!(
        v["overlap"],
        json!({"longest_matched": 16, "gpu": 16, "dp": {"0": 16}, "cpu": 16, "disk": 16})
    );
    assert_eq!(v["effective_prefill_tokens"], json!(4));
    // Only block hashes: the service chains them itself and finds the same prefix.
    let (_, v) = json_call(
        a,
        "POST",
        "/select",
        json!({"model_name": "model", "block_hashes": signed(&local)}),
    )
    .await;
    assert_eq!(
        (v["worker_id"].as_u64(), v["overlap"]["gpu"].as_u64()),
        (Some(1), Some(16))
    );
    // Potential loads count every prompt block not already active on the rank, cached or not.
    let (_, v) = json_call(a, "POST", "/potential_loads", prompt).await;
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["potential_decode_blocks"] == json!(5)));
    // The dump carries the blocks.
    let (_, v) = json_call(a, "GET", "/dump", Value::Null).await;
    let ranks = v["scopes"][0]["ranks"].as_array().unwrap();
    let w1 = ranks.iter().find(|r| r["worker_id"] == json!(1)).unwrap();
    assert_eq!(w1["blocks"].as_array().unwrap().len(), 4);
    // A second selector recovers the index from the first's /dump before it answers: after the
    // same catalog registration it gives the same overlap scores.
    let b = select_service(&["--indexer-peers", &format!("http://{a}")]).await;
    for id in [1, 2] {
        assert_eq!(
            json_call(b.addr, "POST", "/workers", worker(id, 1)).await.0,
            201
        );
    }
    let scores = |addr| {
        let prompt = json!({"model_name": "model", "sequence_hashes": signed(&longer)});
        async move { json_call(addr, "POST", "/overlap_scores", prompt).await.1 }
    };
    assert_eq!(scores(b.addr).await, scores(a).await);
    assert_eq!(scores(b.addr).await[0]["gpu"], json!(16));
    let (_, dump_b) = json_call(b.addr, "GET", "/dump", Value::Null).await;
    let (_, dump_a) = json_call(a, "GET", "/dump", Value::Null).await;
    assert_eq!(dump_b, dump_a, "an equal index");
    b.stop().await;
    // Removing the worker stops its subscription and forgets its blocks.
    assert_eq!(
        json_call(a, "DELETE", "/workers/1", Value::Null).await.0,
        200
    );
    let (_, v) = json_call(
        a,
        "POST",
        "/overlap_scores",
        json!({"model_name": "model", "sequence_hashes": signed(&seq)}),
    )
    .await;
    assert_eq!(v.as_array().unwrap().len(), 1);
    publisher.quit().await;
    s.stop().await;
}

/// A `session_id` keeps selections on the rank its reservation bound it to, even where another
/// rank is idle; an oversized id is ignored (and said so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_stick_to_the_rank_their_reservation_bound() {
    let s = select_service(&["--threads", "2"]).await;
    let a = s.addr;
    for id in [1, 2] {
        assert_eq!(json_call(a, "POST", "/workers", worker(id, 1)).await.0, 201);
    }
    let prompt = |session: &str| json!({"model_name": "model", "block_hashes": [11, 12, 13, 14], "session_id": session});
    let (st, first) = json_call(a, "POST", "/select_and_reserve", prompt("chat-1")).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(first["session"], json!("new"));
    let home = first["worker_id"].clone();
    // The session's rank holds a reservation; a selection without the session picks the idle one,
    // with it the bound one.
    let (_, v) = json_call(
        a,
        "POST",
        "/select",
        json!({"model_name": "model", "block_hashes": [21, 22, 23, 24]}),
    )
    .await;
    assert_ne!(v["worker_id"], home, "{v}");
    assert!(v.get("session").is_none());
    for _ in 0..3 {
        let (_, v) = json_call(a, "POST", "/select_and_reserve", prompt("chat-1")).await;
        assert_eq!((&v["worker_id"], &v["session"]), (&home, &json!("hit")));
    }
    let (st, v) = json_call(a, "POST", "/select", prompt(&"s".repeat(300))).await;
    assert_eq!((st, &v["session"]), (200, &json!("ignored")));
    s.stop().await;
}
