//! Fault injection with real processes on loopback: the `kvepp` binary killed (SIGKILL) and
//! restarted under load behind a real Envoy, fail-open and fail-close; an endpoint that disappears
//! with requests in flight. (KV-event publisher restarts and gaps larger than the replay buffer:
//! `tests/kv/kv_routing/` and `tests/kv/kv_events_zmq.rs`; the API server killed under a watch and a
//! real 410 Gone: `tests/kubernetes/`.) Recovery times are printed and appended to
//! `target/fault-recovery.txt`.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvepp_test_support::client::fetch;

use kvepp_test_support::prelude::*;
use kvepp_test_support::TempDir;
use tokio::process::{Child, Command};
use tokio::sync::watch;

const BIN: &str = env!("CARGO_BIN_EXE_kvepp");

/// A `kvepp serve` process on fixed ports (so a restart takes the same ones).
struct KveppProcess {
    child: Child,
    grpc: u16,
    metrics: u16,
    health: u16,
    dir: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl KveppProcess {
    fn spawn(dir: &std::path::Path, grpc: u16, health: u16, metrics: u16) -> KveppProcess {
        static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = dir.join(format!("kvepp-{grpc}-{n}.log"));
        let child = Command::new(BIN)
            .args([
                "serve",
                "--pool-name",
                "pool",
                "--bind-address",
                "127.0.0.1",
            ])
            .arg("--manifests-dir")
            .arg(dir)
            .args(["--manifests-poll-ms", "20", "--shutdown-grace-seconds", "1"])
            .args(["--grpc-port", &grpc.to_string()])
            .args(["--grpc-health-port", &health.to_string()])
            .args(["--metrics-port", &metrics.to_string()])
            .env("KVEPP_LOG_LEVEL", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        KveppProcess {
            child,
            grpc,
            metrics,
            health,
            dir: dir.to_owned(),
            log,
        }
    }

    /// Waits for `/ready`; a process that exits first (a port taken meanwhile, say) fails the
    /// test at once with its log instead of at the deadline.
    async fn ready(&mut self) {
        let addr: SocketAddr = ([127, 0, 0, 1], self.metrics).into();
        let exited = std::sync::Mutex::new(None);
        let child = std::sync::Mutex::new(&mut self.child);
        wait_for("kvepp ready", || async {
            if let Ok(Some(status)) = child.lock().unwrap().try_wait() {
                *exited.lock().unwrap() = Some(status);
                return Some(());
            }
            matches!(fetch(addr, "/ready").await, Ok((200, _))).then_some(())
        })
        .await;
        if let Some(status) = exited.into_inner().unwrap() {
            panic!(
                "kvepp exited before it was ready ({status}):\n{}",
                self.log()
            );
        }
    }

    /// SIGKILL: no drain, streams cut mid-flight.
    async fn kill(&mut self) {
        self.child.kill().await.unwrap();
    }

    fn restart(&mut self) {
        let again = KveppProcess::spawn(&self.dir, self.grpc, self.health, self.metrics);
        *self = again;
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The local bootstrap with the ext_proc filter's failure mode set, plus (fail-open) a route that
/// sends requests kvepp did not decide to the pool's endpoints through an ordinary cluster: after
/// kvepp's header answer Envoy re-evaluates the route (`route_cache_action: CLEAR`).
fn bootstrap_with(fail_open: bool, backends: &[SocketAddr]) -> serde_yaml::Value {
    let mut b = bootstrap();
    let ext = ext_proc_config(&mut b);
    ext["failure_mode_allow"] = fail_open.into();
    if fail_open {
        // Envoy fails open in FULL_DUPLEX_STREAMED only until the first body chunk has gone to the
        // processor; a fail-open deployment buffers the request body (and its response body).
        ext["processing_mode"]["request_body_mode"] = "BUFFERED".into();
        ext["processing_mode"]["response_body_mode"] = "BUFFERED".into();
    }
    ext["route_cache_action"] = "CLEAR".into();
    // Shorter than a test's patience: a dead EPP is found out by the connect, not by a timeout.
    ext["message_timeout"] = "5s".into();
    let routes: serde_yaml::Value = serde_yaml::from_str(
        r#"
- match:
    prefix: "/"
    headers: [{name: x-gateway-destination-endpoint, present_match: true}]
  route: {cluster: inference_pool, timeout: 30s}
- match: {prefix: "/"}
  route: {cluster: pool_fallback, timeout: 30s}
"#,
    )
    .unwrap();
    b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["route_config"]["virtual_hosts"][0]["routes"] = routes;
    let endpoints: Vec<serde_yaml::Value> = backends
        .iter()
        .map(|a| {
            serde_yaml::from_str(&format!(
                "endpoint: {{address: {{socket_address: {{address: {}, port_value: {}}}}}}}",
                a.ip(),
                a.port()
            ))
            .unwrap()
        })
        .collect();
    let mut fallback: serde_yaml::Value = serde_yaml::from_str(
        "name: pool_fallback\ntype: STATIC\nconnect_timeout: 2s\nload_assignment: {cluster_name: pool_fallback, endpoints: [{lb_endpoints: []}]}",
    )
    .unwrap();
    fallback["load_assignment"]["endpoints"][0]["lb_endpoints"] = endpoints.into();
    b["static_resources"]["clusters"]
        .as_sequence_mut()
        .unwrap()
        .push(fallback);
    b
}

fn report(line: &str) {
    println!("{line}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fault-recovery.txt");
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        use std::io::Write;
        let _ = writeln!(f, "{line}");
    }
}

async fn kill_and_restart_under_load(fail_open: bool) {
    let backends = echo_backends(&["a", "b"]).await;
    let dir = TempDir::new("faults");
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", backends[0], true);
    m += &slice_yaml("b", backends[1], true);
    std::fs::write(dir.path().join("pool.yaml"), m).unwrap();
    let mut kvepp = KveppProcess::spawn(dir.path(), free_port(), free_port(), free_port());
    kvepp.ready().await;
    let envoy = Envoy::start(
        bootstrap_with(fail_open, &backends),
        ([127, 0, 0, 1], kvepp.grpc).into(),
    )
    .await;
    let (stop_tx, stop) = watch::channel(false);
    let (log, clients) = steady_load(envoy.addr, 4, stop);
    let mode = if fail_open { "fail-open" } else { "fail-close" };

    wait_for("decided requests before the kill", || async {
        (count(&log, |o| o.decided) >= 40).then_some(())
    })
    .await;
    // Taken before the kill: Envoy may see the connection reset before `kill` returns.
    let killed = Instant::now();
    kvepp.kill().await;
    // An outage of at least a second, with at least 40 requests sent during it.
    wait_for("an outage under load", || async {
        (killed.elapsed() > Duration::from_secs(1) && count(&log, |o| o.start > killed) >= 40)
            .then_some(())
    })
    .await;
    let restarted = Instant::now();
    kvepp.restart();
    let recovered = wait_for("kvepp deciding again", || async {
        log.lock()
            .unwrap()
            .iter()
            .filter(|o| o.decided && o.start > restarted)
            .map(|o| o.end)
            .min()
    })
    .await;
    wait_for("decided requests after recovery", || async {
        (count(&log, |o| o.decided && o.start > recovered) >= 40).then_some(())
    })
    .await;
    let _ = stop_tx.send(true);
    for c in clients {
        c.await.unwrap();
    }
    let log = log.lock().unwrap().clone();
    let failed: Vec<&Outcome> = log.iter().filter(|o| o.status != 200).collect();
    let down = log
        .iter()
        .filter(|o| o.start > killed && o.end < recovered)
        .count();
    report(&format!(
        "{mode}: {} requests, {} failed, {down} while kvepp was down; back deciding {} ms after the restart ({} ms after the kill)",
        log.len(),
        failed.len(),
        (recovered - restarted).as_millis(),
        (recovered - killed).as_millis(),
    ));
    if fail_open {
        assert!(
            failed.is_empty(),
            "fail-open: {} requests failed: {:?}\nkvepp: {}\nenvoy: {}",
            failed.len(),
            &failed[..failed.len().min(5)],
            kvepp.log(),
            envoy.log()
        );
        assert!(
            log.iter()
                .any(|o| o.start > killed && o.end < restarted && !o.decided),
            "requests went through the fallback route while kvepp was down"
        );
    } else {
        assert!(
            !failed.is_empty(),
            "fail-close: nothing failed while kvepp was down"
        );
        let at = |t: Instant| t.saturating_duration_since(killed).as_millis();
        for o in &failed {
            assert!(
                o.end >= killed && o.start <= recovered,
                "fail-close: a failure outside the outage (ms after the kill: started {}, ended {}; restart {}, recovered {}): {o:?}\nkvepp: {}\nenvoy: {}",
                at(o.start), at(o.end), at(restarted), at(recovered), kvepp.log(), envoy.log()
            );
            assert_eq!(o.status, 500, "{o:?}");
        }
        // Nothing reached a backend without a decision.
        assert!(log.iter().filter(|o| o.status == 200).all(|o| o.decided));
    }
    drop(envoy);
    kvepp.kill().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_survives_a_killed_kvepp_without_a_failed_request() {
    kill_and_restart_under_load(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_close_fails_only_while_kvepp_is_down() {
    kill_and_restart_under_load(false).await;
}

/// A model server whose responses start at once and finish only when `release` turns true.
async fn holding_backend(
    release: watch::Receiver<bool>,
) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    use axum::body::{Body, Bytes};
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = seen.clone();
    let app = axum::Router::new().fallback(move || {
        let mut release = release.clone();
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(2);
            tokio::spawn(async move {
                let _ = tx.send(Ok(Bytes::from_static(b"{\"first\":true}\n"))).await;
                let _ = release.wait_for(|r| *r).await;
                let _ = tx.send(Ok(Bytes::from_static(b"{\"done\":true}\n"))).await;
            });
            axum::response::Response::new(Body::from_stream(
                tokio_stream::wrappers::ReceiverStream::new(rx),
            ))
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, seen)
}

/// Active decode blocks the slot tracker holds over every worker of the pool.
async fn booked_blocks(slots: SocketAddr) -> u64 {
    let r = http(slots, "GET", "/loads", &[], "").await;
    r.json()
        .as_array()
        .map(|rows| {
            rows.iter()
                .filter_map(|row| row["active_decode_blocks"].as_u64())
                .sum()
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_that_disappears_with_requests_in_flight_leaks_no_booking() {
    let (release_tx, release) = watch::channel(false);
    let (a, seen) = holding_backend(release).await;
    let pool = pool_yaml("pool") + &standard_models();
    let epp = Epp::start(&(pool.clone() + &slice_yaml("a", a, true)), |c| {
        c.slot_tracker_port = Some(0);
        c.engine_metrics.enabled = false;
    })
    .await;
    let slots = epp.slot_tracker.unwrap();
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    let long = "the same long prompt, over many KV blocks ".repeat(40);
    let send = |i: usize| {
        let (addr, body) = (
            envoy.addr,
            format!("{{\"model\":\"m\",\"prompt\":\"{i} {long}\"}}"),
        );
        tokio::spawn(async move { post_json(addr, body).await })
    };
    let held: Vec<_> = (0..3).map(send).collect();
    wait_for("three requests held by a", || async {
        (seen.load(std::sync::atomic::Ordering::SeqCst) == 3).then_some(())
    })
    .await;
    wait_for("their bookings", || async {
        (booked_blocks(slots).await > 0).then_some(())
    })
    .await;
    assert_eq!(epp.metric("kvepp_in_flight_requests").await, Some(3.0));

    // a leaves the pool while its three responses are still streaming, then they finish.
    epp.write_manifest("pool.yaml", &pool);
    wait_for("a gone from the pool", || async {
        (epp.metric("kvepp_ready_endpoints").await == Some(0.0)).then_some(())
    })
    .await;
    release_tx.send(true).unwrap();
    for h in held {
        let r = h.await.unwrap();
        assert_eq!(r.status, 200, "a request in flight was cut");
    }
    // a comes back: nothing of the three requests is still booked on it.
    epp.write_manifest("pool.yaml", &(pool + &slice_yaml("a", a, true)));
    wait_for("a back in the pool", || async {
        (epp.metric("kvepp_ready_endpoints").await == Some(1.0)).then_some(())
    })
    .await;
    wait_for("a's loads listed", || async {
        let r = http(slots, "GET", "/loads", &[], "").await;
        (r.json().as_array().is_some_and(|rows| !rows.is_empty())).then_some(())
    })
    .await;
    assert_eq!(booked_blocks(slots).await, 0, "bookings leaked");
    assert_eq!(epp.metric("kvepp_in_flight_requests").await, Some(0.0));
    // And it books and releases as usual.
    let r = send(9).await.unwrap();
    assert_eq!(r.status, 200);
    wait_for("released after the response", || async {
        (booked_blocks(slots).await == 0).then_some(())
    })
    .await;
    drop(envoy);
    epp.stop().await;
}
