//! Replica sync between real service processes (the `kvepp` binary) over real ZMQ on 127.0.0.1: admissions,
//! prefill completions and frees on one replica show in the other's loads; output blocks stay
//! local; events for workers the receiver does not know are dropped; peers added and removed at run
//! time are followed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;

use kvepp_test_support::harness::{free_port, http, wait_for};
use serde_json::{json, Value};

/// A service as a real process: `kvepp <sub> --host 127.0.0.1 --port <free> <args>`.
struct Service {
    addr: SocketAddr,
    child: tokio::process::Child,
}

impl Service {
    async fn start(sub: &str, args: &[String]) -> Service {
        Self::start_on(sub, free_port(), args).await
    }

    async fn start_on(sub: &str, port: u16, args: &[String]) -> Service {
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvepp"))
            .args([sub, "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn kvepp");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        wait_for("the service answering", || async move {
            let up = tokio::net::TcpStream::connect(addr).await.is_ok();
            up.then_some(())
        })
        .await;
        Service { addr, child }
    }

    /// SIGKILL: no goodbye to the peers.
    async fn kill(mut self) {
        self.child.kill().await.expect("kill");
    }

    async fn stop(mut self) {
        assert!(
            self.child.try_wait().expect("status").is_none(),
            "still running"
        );
        self.child.kill().await.expect("kill");
    }
}

async fn slot_tracker(args: &[String]) -> Service {
    Service::start("slot-tracker", args).await
}

async fn select_service(args: &[String]) -> Service {
    Service::start("select-service", args).await
}

async fn call(addr: SocketAddr, method: &str, path: &str, body: Value) -> (u16, Value) {
    let body = if body.is_null() {
        String::new()
    } else {
        body.to_string()
    };
    let r = http(
        addr,
        method,
        path,
        &[("content-type", "application/json")],
        body,
    )
    .await;
    let v = if r.body.is_empty() {
        Value::Null
    } else {
        r.json()
    };
    (r.status, v)
}

/// The (active_prefill_tokens, active_decode_blocks) of worker `w` rank `r` in `GET /loads`.
async fn load_of(addr: SocketAddr, w: u64, r: u64) -> Option<(u64, u64)> {
    let (_, v) = call(addr, "GET", "/loads", Value::Null).await;
    let row = v
        .as_array()?
        .iter()
        .find(|l| l["worker_id"] == json!(w) && l["dp_rank"] == json!(r))?
        .clone();
    Some((
        row["active_prefill_tokens"].as_u64()?,
        row["active_decode_blocks"].as_u64()?,
    ))
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

fn register(worker: u64) -> Value {
    json!({"worker_id": worker, "model_name": "m", "block_size": 16, "dp_start": 0, "dp_size": 2})
}

fn add(id: &str, worker: u64, prefill: u64) -> Value {
    json!({"model_name": "m", "request_id": id, "worker_id": worker, "dp_rank": 1,
           "sequence_hashes": [1, 2, -3], "new_isl_tokens": prefill})
}

/// ZMQ subscriptions take a moment to establish (events published before are lost, as the seed
/// says): probe until one of `from`'s admissions reaches `to`, then free the probes.
async fn until_synced(from: SocketAddr, to: SocketAddr, worker: u64) {
    let mut n = 0u32;
    wait_for("replica sync established", || {
        n += 1;
        let id = format!("probe-{n}");
        async move {
            assert_eq!(call(from, "POST", "/add", add(&id, worker, 1)).await.0, 201);
            let seen = load_of(to, worker, 1).await.is_some_and(|(p, _)| p > 0);
            seen.then_some(())
        }
    })
    .await;
    for i in 1..=n {
        let r = json!({"model_name": "m", "request_id": format!("probe-{i}")});
        call(from, "POST", "/free", r).await;
    }
    wait_for("probes freed on both", || async {
        let a = load_of(from, worker, 1).await == Some((0, 0));
        let b = load_of(to, worker, 1).await == Some((0, 0));
        (a && b).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_trackers_share_admission_prefill_and_free() {
    let (pa, pb) = (free_port(), free_port());
    let (ea, eb) = (
        format!("tcp://127.0.0.1:{pa}"),
        format!("tcp://127.0.0.1:{pb}"),
    );
    let a = slot_tracker(&s(&[
        "--replica-sync-bind",
        &format!("tcp://*:{pa}"),
        "--replica-sync-advertise",
        &ea,
        "--replica-sync-peers",
        &eb,
    ]))
    .await;
    let b = slot_tracker(&s(&[
        "--replica-sync-bind",
        &format!("tcp://*:{pb}"),
        "--replica-sync-advertise",
        &eb,
        "--replica-sync-peers",
        &ea,
    ]))
    .await;
    for svc in [&a, &b] {
        assert_eq!(
            call(svc.addr, "POST", "/register", register(7)).await.0,
            201
        );
    }
    // Worker 9 only on A: B drops its events.
    assert_eq!(call(a.addr, "POST", "/register", register(9)).await.0, 201);
    until_synced(a.addr, b.addr, 7).await;
    until_synced(b.addr, a.addr, 7).await;

    assert_eq!(call(a.addr, "POST", "/add", add("r1", 7, 48)).await.0, 201);
    assert_eq!(call(a.addr, "POST", "/add", add("r9", 9, 5)).await.0, 201);
    wait_for("admission on B", || async {
        (load_of(b.addr, 7, 1).await == Some((48, 3))).then_some(())
    })
    .await;
    // Output blocks are not a slot-tracker route; prefill completion and free are shared.
    let r1 = json!({"model_name": "m", "request_id": "r1"});
    assert_eq!(
        call(a.addr, "POST", "/prefill_complete", r1.clone())
            .await
            .0,
        200
    );
    wait_for("prefill complete on B", || async {
        (load_of(b.addr, 7, 1).await == Some((0, 3))).then_some(())
    })
    .await;
    assert_eq!(call(a.addr, "POST", "/free", r1).await.0, 200);
    wait_for("free on B", || async {
        (load_of(b.addr, 7, 1).await == Some((0, 0))).then_some(())
    })
    .await;
    assert_eq!(
        load_of(b.addr, 9, 1).await,
        None,
        "B never learned worker 9"
    );
    // A replicated request is known on the peer: the same id is a duplicate there too.
    assert_eq!(call(a.addr, "POST", "/add", add("dup", 7, 20)).await.0, 201);
    wait_for("`dup` on B", || async {
        (load_of(b.addr, 7, 1).await?.0 == 20).then_some(())
    })
    .await;
    assert_eq!(call(b.addr, "POST", "/add", add("dup", 7, 10)).await.0, 409);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_registered_at_run_time_are_followed_and_removed() {
    let pa = free_port();
    let ea = format!("tcp://127.0.0.1:{pa}");
    let a = slot_tracker(&s(&["--replica-sync-bind", &ea])).await;
    let pc = free_port();
    let c = slot_tracker(&s(&[
        "--replica-sync-bind",
        &format!("tcp://127.0.0.1:{pc}"),
    ]))
    .await;
    for svc in [&a, &c] {
        assert_eq!(
            call(svc.addr, "POST", "/register", register(7)).await.0,
            201
        );
    }
    assert_eq!(
        call(c.addr, "POST", "/register_peer", json!({"url": ea})).await,
        (200, json!({"status": "ok"}))
    );
    until_synced(a.addr, c.addr, 7).await;
    assert_eq!(
        call(c.addr, "POST", "/deregister_peer", json!({"url": ea}))
            .await
            .0,
        200
    );
    assert_eq!(
        call(c.addr, "GET", "/peers", Value::Null).await.1,
        json!([])
    );
    // After deregistration, A's admissions no longer reach C (several, so one would have).
    for i in 0..20 {
        assert_eq!(
            call(a.addr, "POST", "/add", add(&format!("late-{i}"), 7, 1))
                .await
                .0,
            201
        );
    }
    wait_for("A holds its own", || async {
        (load_of(a.addr, 7, 1).await?.0 == 20).then_some(())
    })
    .await;
    // A round trip through C's HTTP server after A's publishes: nothing arrived.
    assert_eq!(load_of(c.addr, 7, 1).await, Some((0, 0)));
    a.stop().await;
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selection_services_share_reservations() {
    let (pa, pb) = (free_port(), free_port());
    let a = select_service(&s(&[
        "--replica-sync-port",
        &pa.to_string(),
        "--replica-sync-peers",
        &format!("tcp://127.0.0.1:{pb}"),
    ]))
    .await;
    let b = select_service(&s(&[
        "--replica-sync-port",
        &pb.to_string(),
        "--replica-sync-peers",
        &format!("tcp://127.0.0.1:{pa}"),
    ]))
    .await;
    let worker = json!({"worker_id": 1, "model_name": "m", "block_size": 16});
    for svc in [&a, &b] {
        assert_eq!(
            call(svc.addr, "POST", "/workers", worker.clone()).await.0,
            201
        );
    }
    let sel = |id: &str| json!({"reservation_id": id, "model_name": "m", "sequence_hashes": [5, 6], "isl_tokens": 32});
    let mut n = 0;
    wait_for("a reservation on A reaches B", || {
        n += 1;
        let id = format!("warm-{n}");
        async move {
            let (st, _) = call(a.addr, "POST", "/select_and_reserve", sel(&id)).await;
            assert_eq!(st, 200);
            let seen = load_of(b.addr, 1, 0).await.is_some_and(|(p, _)| p >= 32);
            seen.then_some(id)
        }
    })
    .await;
    // Warm reservations still on their way may reach B after this point; a probe of 48 prefill
    // tokens (the warm ones book 32) tells when B has every reservation A published before it:
    // A's events reach B in order.
    let b0 = load_of(b.addr, 1, 0).await.unwrap().0;
    let probe = json!({"reservation_id": "probe", "model_name": "m", "sequence_hashes": [5, 6], "isl_tokens": 48});
    assert_eq!(
        call(a.addr, "POST", "/select_and_reserve", probe).await.0,
        200
    );
    let id = "probe".to_owned();
    let before = wait_for("the probe on B", || async {
        let l = load_of(b.addr, 1, 0).await?;
        (l.0 >= b0 + 48 && (l.0 - b0) % 32 == 16).then_some(l)
    })
    .await;
    // B's loads count it; output blocks on A stay local; prefill completion and free travel.
    assert_eq!(
        call(
            a.addr,
            "POST",
            &format!("/reservations/{id}/output_block"),
            Value::Null
        )
        .await
        .0,
        200
    );
    assert_eq!(
        call(
            a.addr,
            "POST",
            &format!("/reservations/{id}/prefill_complete"),
            Value::Null
        )
        .await
        .0,
        200
    );
    wait_for("prefill complete on B", || async {
        (load_of(b.addr, 1, 0).await?.0 == before.0 - 48).then_some(())
    })
    .await;
    assert_eq!(
        load_of(b.addr, 1, 0).await.unwrap().1,
        before.1,
        "output block stayed on A"
    );
    for i in (1..=n).map(|i| format!("warm-{i}")).chain([id]) {
        call(a.addr, "DELETE", &format!("/reservations/{i}"), Value::Null).await;
    }
    wait_for("frees on B", || async {
        (load_of(b.addr, 1, 0).await? == (0, 0)).then_some(())
    })
    .await;
    // Explicit reservations on B reach A (B → A may not be subscribed yet: retry with new ids, as
    // replica sync's best effort allows; each one that arrives books 8 prefill tokens on one block).
    let mut k = 0;
    let (prefill, blocks) = wait_for("B's reservations on A", || {
        k += 1;
        let res = json!({"reservation_id": format!("explicit-{k}"), "model_name": "m",
                         "worker_id": 1, "sequence_hashes": [9], "isl_tokens": 16,
                         "effective_prefill_tokens": 8});
        async move {
            assert_eq!(call(b.addr, "POST", "/reservations", res).await.0, 201);
            load_of(a.addr, 1, 0).await.filter(|(p, _)| *p > 0)
        }
    })
    .await;
    assert_eq!(
        (prefill % 8, blocks),
        (0, 1),
        "8 tokens per reservation, one shared block"
    );
    a.stop().await;
    b.stop().await;
}

/// A killed peer neither blocks nor corrupts the survivor; restarted (empty), it syncs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_and_restarted_peer_neither_blocks_nor_corrupts_the_survivor() {
    let (pa, pb) = (free_port(), free_port());
    let (ea, eb) = (
        format!("tcp://127.0.0.1:{pa}"),
        format!("tcp://127.0.0.1:{pb}"),
    );
    let args_a = s(&["--replica-sync-bind", &ea, "--replica-sync-peers", &eb]);
    let args_b = s(&["--replica-sync-bind", &eb, "--replica-sync-peers", &ea]);
    let a = slot_tracker(&args_a).await;
    let b = slot_tracker(&args_b).await;
    let b_port = b.addr.port();
    for svc in [&a, &b] {
        assert_eq!(
            call(svc.addr, "POST", "/register", register(7)).await.0,
            201
        );
    }
    until_synced(a.addr, b.addr, 7).await;
    until_synced(b.addr, a.addr, 7).await;
    // B holds one of its own requests, replicated to A; then B dies without a word.
    assert_eq!(
        call(b.addr, "POST", "/add", add("from-b", 7, 30)).await.0,
        201
    );
    wait_for("B's request on A", || async {
        (load_of(a.addr, 7, 1).await? == (30, 3)).then_some(())
    })
    .await;
    b.kill().await;
    // A keeps answering, and its own accounting is exact.
    for i in 0..50 {
        assert_eq!(
            call(a.addr, "POST", "/add", add(&format!("a-{i}"), 7, 1))
                .await
                .0,
            201
        );
    }
    for i in 0..50 {
        let r = json!({"model_name": "m", "request_id": format!("a-{i}")});
        assert_eq!(call(a.addr, "POST", "/free", r).await.0, 200);
    }
    assert_eq!(
        load_of(a.addr, 7, 1).await,
        Some((30, 3)),
        "only the dead peer's request remains (it expires after 300 s)"
    );
    // B comes back empty on the same ports; sync resumes both ways.
    let b = Service::start_on("slot-tracker", b_port, &args_b).await;
    assert_eq!(call(b.addr, "POST", "/register", register(7)).await.0, 201);
    let r = json!({"model_name": "m", "request_id": "from-b"});
    assert_eq!(call(a.addr, "POST", "/free", r).await.0, 200);
    until_synced(a.addr, b.addr, 7).await;
    until_synced(b.addr, a.addr, 7).await;
    a.stop().await;
    b.stop().await;
}
