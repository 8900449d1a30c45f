//! The standalone selection service and slot tracker over real HTTP on 127.0.0.1, route by route:
//! every status code and body shape seeds 001 and 004 name, the `{"error": ...}` shape for
//! malformed JSON, oversized bodies, unknown routes and wrong methods, and `/select` answering from
//! a real ZMQ publisher's KV events.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;

use common::publisher::Publisher;
use common::{free_port, http, wait_for, HttpResponse};
use kvepp::services::{SelectArgs, SlotTrackerArgs};
use serde_json::{json, Value};

struct Service {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvepp::services::ServiceError>>,
}

impl Service {
    async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.task.await.expect("join").expect("served cleanly");
    }
}

async fn listener() -> tokio::net::TcpListener {
    kvepp::services::bind([127, 0, 0, 1].into(), 0)
        .await
        .expect("bind")
}

async fn slot_tracker(args: &[&str]) -> Service {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: SlotTrackerArgs,
    }
    let cli = Cli::try_parse_from(std::iter::once("slot-tracker").chain(args.iter().copied()))
        .expect("flags");
    let l = listener().await;
    let addr = l.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvepp::services::run_slot_tracker(cli.args, l, async {
        let _ = stopped.await;
    }));
    Service {
        addr,
        stop: Some(stop),
        task,
    }
}

async fn select_service(args: &[&str]) -> Service {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: SelectArgs,
    }
    let cli = Cli::try_parse_from(std::iter::once("select-service").chain(args.iter().copied()))
        .expect("flags");
    let l = listener().await;
    let addr = l.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(kvepp::services::run_select(cli.args, l, async {
        let _ = stopped.await;
    }));
    Service {
        addr,
        stop: Some(stop),
        task,
    }
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: Value) -> HttpResponse {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    http(
        addr,
        method,
        path,
        &[("content-type", "application/json")],
        body,
    )
    .await
}

/// Status and JSON body; asserts the error shape on 4xx/5xx.
async fn json_call(addr: SocketAddr, method: &str, path: &str, body: Value) -> (u16, Value) {
    let r = call(addr, method, path, body).await;
    let v = r.json();
    if r.status >= 400 {
        let msg = v["error"]
            .as_str()
            .unwrap_or_else(|| panic!("error shape: {v}"));
        assert!(!msg.is_empty());
        assert_eq!(v.as_object().map(|o| o.len()), Some(1), "only `error`: {v}");
    }
    (r.status, v)
}

/// Malformed JSON, oversized bodies, unknown routes and wrong methods: `{"error": ...}` with a
/// precise status, on both services.
async fn error_shapes(addr: SocketAddr, post_route: &str, get_route: &str) {
    let r = http(
        addr,
        "POST",
        post_route,
        &[("content-type", "application/json")],
        "{not json",
    )
    .await;
    assert_eq!(r.status, 400, "malformed JSON");
    assert!(r.json()["error"].is_string());
    let big = format!("{{\"x\": \"{}\"}}", "a".repeat(3 << 20));
    let r = http(
        addr,
        "POST",
        post_route,
        &[("content-type", "application/json")],
        big,
    )
    .await;
    assert_eq!(r.status, 413, "oversized body");
    assert!(r.json()["error"].is_string());
    let r = http(addr, "GET", "/no/such/route", &[], "").await;
    assert_eq!(r.status, 404);
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("/no/such/route"));
    let r = http(addr, "DELETE", get_route, &[], "").await;
    assert_eq!(r.status, 405, "wrong method");
    assert!(r.json()["error"].is_string());
    let r = http(addr, "POST", post_route, &[], "{}").await;
    assert_eq!(r.status, 415, "no JSON content type");
    assert!(r.json()["error"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_tracker_routes_statuses_and_shapes() {
    let s = slot_tracker(&[]).await;
    let a = s.addr;
    let r = http(a, "GET", "/health", &[], "").await;
    assert_eq!(
        (r.status, r.body.len()),
        (200, 0),
        "health: 200, empty body"
    );

    let reg = |id: u64, model: &str, bs: i64, start: u64, size: i64| {
        json!({"worker_id": id, "model_name": model, "tenant_id": "default",
               "block_size": bs, "dp_start": start, "dp_size": size})
    };
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

    // Lifecycle.
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

    // Peers.
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

    error_shapes(a, "/add", "/loads").await;
    s.stop().await;
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

fn worker(id: u64, ranks: u32) -> Value {
    json!({"worker_id": id, "model_name": "model", "tenant_id": "default",
           "endpoint": format!("http://worker-{id}:8000"), "block_size": 4,
           "data_parallel_start_rank": 0, "data_parallel_size": ranks})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn select_service_routes_statuses_and_shapes() {
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

    // Zero overlap: the selected rank is in `dp` with 0; absent ids omitted.
    let sel = json!({"model_name": "model", "tenant_id": "default",
                     "block_hashes": [11, 12, 13, 14], "sequence_hashes": [21, 22, 23, 24],
                     "isl_tokens": 16});
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

    // Explicit reservations.
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

    // Inspection.
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

    // PATCH updates supplied fields only.
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

    // Replica-sync peers.
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

    error_shapes(a, "/select", "/loads").await;
    s.stop().await;
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

/// (METHOD, path) of every operation in an OpenAPI document.
fn documented(doc: &str) -> std::collections::BTreeSet<(String, String)> {
    let v: serde_yaml::Value = serde_yaml::from_str(doc).expect("OpenAPI YAML");
    let mut out = std::collections::BTreeSet::new();
    for (path, item) in v["paths"].as_mapping().expect("paths") {
        for (method, _) in item.as_mapping().expect("path item") {
            let m = method.as_str().unwrap();
            if m != "parameters" {
                out.insert((m.to_uppercase(), path.as_str().unwrap().to_owned()));
            }
        }
    }
    out
}

/// The OpenAPI documents list exactly the routes, and every documented operation is served (no
/// unknown-route 404, no 405) by a live service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_documents_match_the_served_routes() {
    use kvepp::api::{select, slot_tracker};
    for (doc, routes, svc) in [
        (select::OPENAPI, select::ROUTES, select_service(&[]).await),
        (
            slot_tracker::OPENAPI,
            slot_tracker::ROUTES,
            slot_tracker(&[]).await,
        ),
    ] {
        let listed: std::collections::BTreeSet<(String, String)> = routes
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(documented(doc), listed, "document and routes agree");
        for (method, path) in &listed {
            let concrete = path
                .replace("{worker_id}", "1")
                .replace("{reservation_id}", "r");
            let r = call(svc.addr, method, &concrete, json!({})).await;
            assert_ne!(r.status, 405, "{method} {path} is served");
            if r.status == 404 {
                let msg = r.json()["error"].as_str().unwrap_or_default().to_owned();
                assert!(
                    !msg.starts_with("no route"),
                    "{method} {path} is served: {msg}"
                );
            }
        }
        // And an undocumented one is not.
        let r = call(svc.addr, "GET", "/undocumented", Value::Null).await;
        assert_eq!(r.status, 404);
        svc.stop().await;
    }
}

/// Schemathesis (from PyPI, installed into .venv by scripts/test.sh) fuzzes both services from
/// their OpenAPI documents, as real processes: no 5xx, and the process never panics. `GET /ready`
/// is left out: its 503 before any worker is registered is the documented answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_fuzzing_from_the_openapi_documents_finds_no_server_error() {
    let root = common::repo_root();
    let st = root.join(".venv/bin/schemathesis");
    assert!(st.exists(), "{} missing: run scripts/test.sh", st.display());
    for (sub, doc, seed) in [
        (
            "select-service",
            "src/api/openapi/select-service.yaml",
            r#"{"worker_id": 1, "model_name": "default", "block_size": 16, "data_parallel_size": 2}"#,
        ),
        (
            "slot-tracker",
            "src/api/openapi/slot-tracker.yaml",
            r#"{"worker_id": 1, "model_name": "default", "block_size": 16, "dp_size": 2}"#,
        ),
    ] {
        let port = free_port();
        let log = kvepp_test_support::TempDir::new("fuzz");
        let stderr = std::fs::File::create(log.path().join("stderr")).unwrap();
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvepp"))
            .args([sub, "--port", &port.to_string(), "--host", "127.0.0.1"])
            .env("RUST_LOG", "warn")
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn kvepp");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        wait_for("the service listening", || async move {
            let ok = tokio::net::TcpStream::connect(addr).await.is_ok();
            ok.then_some(())
        })
        .await;
        let register = if sub == "select-service" {
            "/workers"
        } else {
            "/register"
        };
        assert_eq!(
            call(addr, "POST", register, serde_json::from_str(seed).unwrap())
                .await
                .status,
            201
        );
        let out = tokio::process::Command::new(&st)
            .current_dir(log.path())
            .args([
                "run",
                root.join(doc).to_str().unwrap(),
                "--url",
                &format!("http://{addr}"),
            ])
            .args([
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "25",
                "--seed",
                "7",
            ])
            .args(["--exclude-path", "/ready", "--request-timeout", "5"])
            .env("SCHEMATHESIS_TELEMETRY", "false")
            .output()
            .await
            .expect("run schemathesis");
        let report = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "schemathesis found failures against {sub}:\n{report}"
        );
        let generated = report
            .lines()
            .find(|l| l.contains(" generated"))
            .unwrap_or_default()
            .to_owned();
        assert!(generated.contains("generated"), "{report}");
        println!("{sub}: {}", generated.trim());
        assert!(child.try_wait().unwrap().is_none(), "{sub} still running");
        child.kill().await.unwrap();
        let logged = std::fs::read_to_string(log.path().join("stderr")).unwrap();
        assert!(!logged.contains("panicked"), "{sub} panicked:\n{logged}");
    }
}
