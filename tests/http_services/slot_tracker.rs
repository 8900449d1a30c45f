//! The slot tracker's routes, statuses, shapes and flags.

use super::*;

/// The slot tracker's routes one by one, each case on a tracker of its own: health and the
/// worker registry first, then, with workers registered (worker 7 of `llama` with two ranks,
/// worker 3 of `llama`, worker 7 of `qwen`), a request's lifecycle, peers and the error shape.
mod slot_tracker_routes_statuses_and_shapes {
    use super::*;

    /// A registration body.
    fn registration(id: u64, model: &str, bs: i64, start: u64, size: i64) -> Value {
        json!({"worker_id": id, "model_name": model, "tenant_id": "default",
               "block_size": bs, "dp_start": start, "dp_size": size})
    }

    /// A tracker with worker 7 of `llama` (ranks 0 and 1), worker 3 of `llama` (rank 0) and
    /// worker 7 of `qwen` (rank 4) registered.
    async fn with_workers() -> Service {
        let s = slot_tracker(&[]).await;
        for body in [
            registration(7, "llama", 16, 0, 2),
            json!({"worker_id": 3, "model_name": "llama", "block_size": 16}),
            registration(7, "qwen", 32, 4, 1),
        ] {
            let (st, v) = json_call(s.addr, "POST", "/register", body).await;
            assert_eq!(st, 201, "{v}");
        }
        s
    }

    /// Health (200, empty body), registrations validated (400, 409 for another block size, 422) and listed sorted, filtered by model and tenant.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn health_and_the_worker_registry() {
        let s = slot_tracker(&[]).await;
        let a = s.addr;
        let r = http(a, "GET", "/health", &[], "").await;
        assert_eq!(
            (r.status, r.body.len()),
            (200, 0),
            "health: 200, empty body"
        );

        let reg = registration;
        assert_eq!(
            json_call(a, "POST", "/register", reg(7, "llama", 16, 0, 2)).await,
            (201, json!({"status": "ok"}))
        );
        // tenant_id defaults to "default"; worker ids are per (model, tenant).
        let (st, _) = json_call(
            a,
            "POST",
            "/register",
            json!({"worker_id": 3, "model_name": "llama", "block_size": 16}),
        )
        .await;
        assert_eq!(st, 201);
        assert_eq!(
            json_call(a, "POST", "/register", reg(7, "qwen", 32, 4, 1))
                .await
                .0,
            201
        );
        assert_eq!(
            json_call(a, "POST", "/register", reg(8, "llama", 0, 0, 1))
                .await
                .0,
            400
        );
        assert_eq!(
            json_call(a, "POST", "/register", reg(8, "llama", 16, 0, 0))
                .await
                .0,
            400
        );
        assert_eq!(
            json_call(a, "POST", "/register", reg(8, "llama", 16, 4294967295, 2))
                .await
                .0,
            400,
            "DP range overflow"
        );
        let (st, v) = json_call(a, "POST", "/register", reg(8, "llama", 32, 0, 1)).await;
        assert_eq!(st, 409, "one block size per (model, tenant): {v}");
        assert_eq!(
            json_call(a, "POST", "/register", reg(8, "llama", -16, 0, 1))
                .await
                .0,
            422
        );

        let (st, v) = json_call(a, "GET", "/workers", Value::Null).await;
        assert_eq!(st, 200);
        let ids: Vec<(String, u64)> = v
            .as_array()
            .unwrap()
            .iter()
            .map(|w| {
                (
                    w["model_name"].as_str().unwrap().to_owned(),
                    w["worker_id"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            ids,
            [("llama".into(), 3), ("llama".into(), 7), ("qwen".into(), 7)],
            "sorted"
        );
        assert_eq!(
            v[1],
            json!({"worker_id": 7, "model_name": "llama", "tenant_id": "default",
                   "block_size": 16, "dp_start": 0, "dp_size": 2})
        );
        let (_, v) = json_call(a, "GET", "/workers?model_name=qwen", Value::Null).await;
        assert_eq!(v.as_array().unwrap().len(), 1);
        let (_, v) = json_call(a, "GET", "/workers?tenant_id=other", Value::Null).await;
        assert_eq!(v, json!([]));
        s.stop().await;
    }

    /// A request's lifecycle: `/add` (409 twice, 404 for an unknown rank or tracker, 422 without hashes), the loads and potential loads it makes, `/prefill_complete`, `/free` (idempotent), `/unregister`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_lifecycle_books_and_frees() {
        let s = with_workers().await;
        let a = s.addr;
        let add = |id: &str, rank: u32, hashes: Value, isl: Value| {
            let mut b = json!({"model_name": "llama", "tenant_id": "default", "request_id": id,
                               "worker_id": 7, "dp_rank": rank, "sequence_hashes": hashes});
            if !isl.is_null() {
                b["new_isl_tokens"] = isl;
            }
            b
        };
        assert_eq!(
            json_call(
                a,
                "POST",
                "/add",
                add("req-1", 0, json!([101, -22, 303]), json!(48))
            )
            .await,
            (201, json!({"status": "ok"}))
        );
        assert_eq!(
            json_call(a, "POST", "/add", add("req-1", 0, json!([1]), json!(1)))
                .await
                .0,
            409
        );
        assert_eq!(
            json_call(a, "POST", "/add", add("req-2", 5, json!([1]), json!(1)))
                .await
                .0,
            404,
            "unknown rank"
        );
        let mut unknown_tracker = add("req-3", 0, json!([]), Value::Null);
        unknown_tracker["model_name"] = json!("nope");
        assert_eq!(json_call(a, "POST", "/add", unknown_tracker).await.0, 404);
        let mut no_hashes = add("req-4", 0, json!([]), Value::Null);
        no_hashes.as_object_mut().unwrap().remove("sequence_hashes");
        assert_eq!(
            json_call(a, "POST", "/add", no_hashes).await.0,
            422,
            "sequence_hashes required"
        );
        // Empty hashes and no new_isl_tokens: allowed, counts a request only.
        assert_eq!(
            json_call(a, "POST", "/add", add("req-5", 1, json!([]), Value::Null))
                .await
                .0,
            201
        );
        // Shares two blocks with req-1 (the negative hash is the same 64 bits).
        assert_eq!(
            json_call(
                a,
                "POST",
                "/add",
                add("req-6", 0, json!([101, 18446744073709551594u64]), json!(16))
            )
            .await
            .0,
            201
        );

        let (st, v) = json_call(a, "GET", "/loads?model_name=llama", Value::Null).await;
        assert_eq!(st, 200);
        assert_eq!(
            v,
            json!([
                {"model_name": "llama", "tenant_id": "default", "worker_id": 3, "dp_rank": 0,
                 "active_prefill_tokens": 0, "active_decode_blocks": 0},
                {"model_name": "llama", "tenant_id": "default", "worker_id": 7, "dp_rank": 0,
                 "active_prefill_tokens": 64, "active_decode_blocks": 3},
                {"model_name": "llama", "tenant_id": "default", "worker_id": 7, "dp_rank": 1,
                 "active_prefill_tokens": 0, "active_decode_blocks": 0},
            ])
        );
        let (st, v) = json_call(
            a,
            "POST",
            "/potential_loads",
            json!({"model_name": "llama", "sequence_hashes": [101, -22, 303, 404], "new_isl_tokens": 48}),
        )
        .await;
        assert_eq!(st, 200);
        let mut rows = v.as_array().unwrap().clone();
        rows.sort_by_key(|r| (r["worker_id"].as_u64(), r["dp_rank"].as_u64()));
        assert_eq!(
            rows[1],
            json!({"worker_id": 7, "dp_rank": 0, "potential_prefill_tokens": 112,
                   "potential_decode_blocks": 4, "active_requests": 2})
        );
        assert_eq!(rows.len(), 3);

        let req = |id: &str| json!({"model_name": "llama", "request_id": id});
        assert_eq!(
            json_call(a, "POST", "/prefill_complete", req("req-1")).await,
            (200, json!({"status": "ok"}))
        );
        assert_eq!(
            json_call(a, "POST", "/prefill_complete", req("req-1"))
                .await
                .0,
            200,
            "repeat: no-op"
        );
        assert_eq!(
            json_call(a, "POST", "/prefill_complete", req("ghost"))
                .await
                .0,
            404
        );
        assert_eq!(json_call(a, "POST", "/free", req("req-1")).await.0, 200);
        assert_eq!(
            json_call(a, "POST", "/free", req("req-1")).await.0,
            200,
            "free is idempotent"
        );
        assert_eq!(
            json_call(a, "POST", "/free", req("ghost")).await.0,
            200,
            "even for unknown requests"
        );
        assert_eq!(
            json_call(
                a,
                "POST",
                "/free",
                json!({"model_name": "nope", "request_id": "x"})
            )
            .await
            .0,
            404,
            "unknown tracker"
        );
        let (_, v) = json_call(
            a,
            "GET",
            "/loads?model_name=llama&tenant_id=default",
            Value::Null,
        )
        .await;
        assert_eq!(v[1]["active_prefill_tokens"], json!(16));
        assert_eq!(v[1]["active_decode_blocks"], json!(2));

        let unreg = json!({"worker_id": 7, "model_name": "llama"});
        assert_eq!(
            json_call(a, "POST", "/unregister", unreg.clone()).await,
            (200, json!({"status": "ok"}))
        );
        assert_eq!(json_call(a, "POST", "/unregister", unreg).await.0, 404);
        let (_, v) = json_call(a, "GET", "/loads?model_name=llama", Value::Null).await;
        assert_eq!(
            v.as_array().unwrap().len(),
            1,
            "its ranks and requests are gone: {v}"
        );
        s.stop().await;
    }

    /// Replica-sync peers registered, listed and deregistered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn peers_register_and_deregister() {
        let s = with_workers().await;
        let a = s.addr;
        assert_eq!(
            json_call(
                a,
                "POST",
                "/register_peer",
                json!({"url": "tcp://slot-tracker-b:8092"})
            )
            .await,
            (200, json!({"status": "ok"}))
        );
        assert_eq!(
            json_call(a, "POST", "/register_peer", json!({"url": "tcp://a:1"}))
                .await
                .0,
            200
        );
        assert_eq!(
            json_call(a, "POST", "/register_peer", json!({"url": "http://x"}))
                .await
                .0,
            400
        );
        assert_eq!(
            json_call(a, "GET", "/peers", Value::Null).await.1,
            json!(["tcp://a:1", "tcp://slot-tracker-b:8092"])
        );
        assert_eq!(
            json_call(a, "POST", "/deregister_peer", json!({"url": "tcp://a:1"}))
                .await
                .0,
            200
        );
        assert_eq!(
            json_call(a, "POST", "/deregister_peer", json!({"url": "tcp://a:1"}))
                .await
                .0,
            404
        );
        assert_eq!(
            json_call(a, "GET", "/peers", Value::Null).await.1,
            json!(["tcp://slot-tracker-b:8092"])
        );
        s.stop().await;
    }

    /// Malformed JSON, oversized bodies, unknown routes and wrong methods: one error shape.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn errors_have_one_shape() {
        let s = with_workers().await;
        let a = s.addr;
        error_shapes(a, "/add", "/loads").await;
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_tracker_flags_seed_peers_and_refuse_self() {
    let s = slot_tracker(&[
        "--replica-sync-bind",
        "tcp://*:18092",
        "--replica-sync-advertise",
        "tcp://me:18092",
        "--replica-sync-peers",
        "tcp://b:18092,tcp://a:18092",
    ])
    .await;
    assert_eq!(
        json_call(s.addr, "GET", "/peers", Value::Null).await.1,
        json!(["tcp://a:18092", "tcp://b:18092"])
    );
    assert_eq!(
        json_call(
            s.addr,
            "POST",
            "/register_peer",
            json!({"url": "tcp://me:18092"})
        )
        .await
        .0,
        400,
        "exact self-registration"
    );
    s.stop().await;
}
