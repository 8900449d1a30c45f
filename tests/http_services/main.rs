//! The standalone selection service and slot tracker over real HTTP on 127.0.0.1, route by route:
//! every status code and body shape seeds 001 and 004 name, the `{"error": ...}` shape for
//! malformed JSON, oversized bodies, unknown routes and wrong methods, and `/select` answering from
//! a real ZMQ publisher's KV events.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod openapi;
mod select;
mod slot_tracker;

use std::net::SocketAddr;

use kvepp::standalone::{SelectArgs, SlotTrackerArgs};
use kvepp_test_support::harness::{free_port, http, wait_for, HttpResponse};
use kvepp_test_support::publisher::Publisher;
use serde_json::{json, Value};

struct Service {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kvepp::standalone::ServiceError>>,
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
    kvepp::standalone::bind([127, 0, 0, 1].into(), 0)
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
    let task = tokio::spawn(kvepp::standalone::run_slot_tracker(cli.args, l, async {
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
    let task = tokio::spawn(kvepp::standalone::run_select(cli.args, l, async {
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
