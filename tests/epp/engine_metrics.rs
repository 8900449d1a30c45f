//! Engine metrics: kvepp scrapes each endpoint's Prometheus `/metrics` (vLLM series) and sheds
//! Sheddable requests when every engine is saturated by queue, KV-cache usage, or stale metrics;
//! the block size is learned from `vllm:cache_config_info`. Through a real Envoy, with engines
//! that serve both completions and a `/metrics` page the test controls.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use kvepp_test_support::prelude::*;
use tokio::net::TcpListener;

/// The `/metrics` answer: status and body.
type Page = Arc<Mutex<(StatusCode, String)>>;

fn page(waiting: u32, usage: f64) -> (StatusCode, String) {
    (
        StatusCode::OK,
        format!(
            "# TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
             vllm:num_requests_running{{model_name=\"m\"}} 1\n\
             vllm:kv_cache_usage_perc{{model_name=\"m\"}} {usage}\n\
             vllm:cache_config_info{{block_size=\"32\",num_gpu_blocks=\"1000\"}} 1\n\
             vllm:prefix_cache_queries_total{{model_name=\"m\"}} 10\n\
             vllm:prefix_cache_hits_total{{model_name=\"m\"}} 4\n"
        ),
    )
}

async fn engine(name: &'static str) -> (SocketAddr, Page) {
    let state: Page = Arc::new(Mutex::new(page(0, 0.1)));
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(|State(p): State<Page>| async move { p.lock().expect("lock").clone() }),
        )
        .route(
            "/v1/completions",
            post(move || async move { format!("{{\"backend\":\"{name}\"}}") }),
        )
        .with_state(state.clone());
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    (addr, state)
}

async fn shed_status(envoy: &Envoy) -> u16 {
    post_json(envoy.addr, r#"{"model":"shed","prompt":"hello"}"#)
        .await
        .status
}

async fn until_shed_status(envoy: &Envoy, want: u16) {
    wait_for(&format!("Sheddable answered {want}"), || async move {
        (shed_status(envoy).await == want).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturation_from_engine_metrics_and_learned_block_size() {
    let (a, page_a) = engine("a").await;
    let (b, page_b) = engine("b").await;
    let mut m = pool_yaml("pool") + &standard_models();
    m += &slice_yaml("a", a, true);
    m += &slice_yaml("b", b, true);
    let epp = Epp::start(&m, |c| {
        c.engine_metrics.interval_ms = 20;
        c.engine_metrics.stale_after_ms = 300;
    })
    .await;
    let envoy = Envoy::start(bootstrap(), epp.grpc).await;
    wait_for("block size learned from cache_config_info", || async {
        (epp.metric("kvepp_kv_block_size").await? == 32.0).then_some(())
    })
    .await;
    assert_eq!(shed_status(&envoy).await, 200);
    let ratio = format!("kvepp_engine_prefix_cache_hit_ratio{{endpoint=\"{a}\"}}");
    wait_for("the engine's own hit ratio", || async {
        (epp.metric(&ratio).await? == 0.4).then_some(())
    })
    .await;

    // One engine with a long queue is not enough to shed...
    *page_a.lock().expect("lock") = page(10, 0.1);
    until_shed_status(&envoy, 200).await;
    // ...both are: queue on a, KV cache nearly full on b.
    *page_b.lock().expect("lock") = page(0, 0.95);
    until_shed_status(&envoy, 429).await;
    // Critical traffic is never shed.
    assert_eq!(
        post_json(envoy.addr, r#"{"model":"crit","prompt":"x"}"#)
            .await
            .status,
        200
    );
    *page_b.lock().expect("lock") = page(1, 0.5);
    until_shed_status(&envoy, 200).await;
    // b's metrics go away: once stale, b counts as saturated too.
    *page_b.lock().expect("lock") = (StatusCode::INTERNAL_SERVER_ERROR, String::new());
    until_shed_status(&envoy, 429).await;
    assert!(
        epp.metric("kvepp_engine_metrics_scrape_errors_total")
            .await
            .expect("error counter")
            > 0.0
    );
    *page_a.lock().expect("lock") = page(0, 0.1);
    until_shed_status(&envoy, 200).await;
    drop(envoy);
    epp.stop().await;
}

/// An engine serving `/server_info` as SGLang does, and `/metrics` as `page` says.
async fn sglang_engine(page: (StatusCode, String)) -> SocketAddr {
    let page = Arc::new(page);
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let page = page.clone();
                async move { (*page).clone() }
            }),
        )
        .route(
            "/server_info",
            get(|| async {
                r#"{"page_size": 4, "max_total_num_tokens": 4000, "dp_size": 1, "served_model_name": "m"}"#
            }),
        )
        .route("/v1/completions", post(|| async { "{}" }));
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

/// SGLang without `--enable-metrics` (no metrics page): its kind, page size and capacity come
/// from its `/server_info`; with the engine kind configured, only that engine's series are read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_kind_from_server_info_or_configured() {
    let a = sglang_engine((StatusCode::NOT_FOUND, String::new())).await;
    let m = pool_manifests(&[("a", a)]);
    let epp = Epp::start(&m, |c| c.engine_metrics.interval_ms = 20).await;
    let kind = format!("kvepp_engine_kind{{endpoint=\"{a}\",engine=\"sglang\"}}");
    wait_for("the kind from /server_info", || async {
        (epp.metric(&kind).await? == 1.0).then_some(())
    })
    .await;
    wait_for("the block size from its page size", || async {
        (epp.metric("kvepp_kv_block_size").await? == 4.0).then_some(())
    })
    .await;
    epp.stop().await;

    // A vLLM page read by a kvepp told its engines are SGLang: no kind, a failed scrape.
    let b = sglang_engine(page(0, 0.1)).await;
    let m = pool_manifests(&[("b", b)]);
    let epp = Epp::start(&m, |c| {
        c.engine_metrics.interval_ms = 20;
        c.engine_metrics.engine = kvepp::engine::metrics::EngineSelect::Sglang;
    })
    .await;
    let kind = format!("kvepp_engine_kind{{endpoint=\"{b}\",engine=\"sglang\"}}");
    wait_for("the configured kind, from /server_info", || async {
        (epp.metric(&kind).await? == 1.0).then_some(())
    })
    .await;
    wait_for("the vLLM page counted as a failed scrape", || async {
        (epp.metric("kvepp_engine_metrics_scrape_errors_total")
            .await?
            >= 2.0)
            .then_some(())
    })
    .await;
    assert_eq!(
        epp.metric(&format!(
            "kvepp_engine_kind{{endpoint=\"{b}\",engine=\"vllm\"}}"
        ))
        .await,
        None
    );
    epp.stop().await;
}
