//! HTTP services beside the gRPC ones: Prometheus `/metrics`, liveness `/health`, readiness `/ready`,
//! `/debug/kv-index` (the blocks the KV-event index holds for each ready endpoint), `/debug/config`
//! (the configuration in effect and its version) and `/dump` (the
//! index snapshot another replica recovers from) on the metrics port; and the Dynamo-compatible selection service ([`select`]) and slot tracker
//! ([`slot_tracker`]), standalone or opened by `kvepp serve` over its own routing state.

pub mod auth;
pub(crate) mod json;
pub mod select;
pub mod slot_tracker;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::discovery::Datastore;
use crate::metrics::Metrics;
use kvepp_core::slots::WorkerRank;
use kvepp_core::KvState;

#[derive(Debug, Clone)]
pub struct ApiState {
    pub metrics: Arc<Metrics>,
    pub store: Arc<Datastore>,
    /// The KV-aware picker's state, when that picker runs.
    pub kv: Option<Arc<KvState>>,
    /// The ext_proc door's router (its session bindings go into `/dump`).
    pub router: Option<Arc<kvepp_core::Router>>,
    /// The configuration in effect and its version as `/debug/config` shows them.
    pub config: Option<ConfigView>,
    /// True once kvepp is shutting down: `/ready` answers 503.
    pub draining: Option<tokio::sync::watch::Receiver<bool>>,
}

/// Reads the configuration in effect: `{"version": n, "config": {…}}`.
#[derive(Clone)]
pub struct ConfigView(pub Arc<dyn Fn() -> serde_json::Value + Send + Sync>);

impl std::fmt::Debug for ConfigView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConfigView")
    }
}

/// The metrics port's routes; `/debug/*` needs `token` when one is configured.
pub(crate) fn router(state: ApiState, access: &auth::Access) -> Router {
    let debug = Router::new()
        .route("/debug/kv-index", get(kv_index))
        .route("/debug/endpoints", get(endpoints))
        .route("/debug/config", get(effective_config))
        .with_state(state.clone());
    let open = Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .route("/dump", get(dump))
        .with_state(state);
    open.merge(access.guard(debug, auth::Guarded::All))
}

/// `/debug/config`: `{"version": n, "config": {…}}`, the tree in effect (defaults, file,
/// environment and flags, with every applied reload); 404 where the process has none.
async fn effective_config(State(st): State<ApiState>) -> axum::response::Response {
    let Some(view) = &st.config else {
        return (StatusCode::NOT_FOUND, "no configuration here\n").into_response();
    };
    axum::Json((view.0)()).into_response()
}

async fn metrics(State(st): State<ApiState>) -> impl IntoResponse {
    let snap = st.store.snapshot();
    let in_flight: i64 = snap
        .endpoints
        .iter()
        .map(|e| i64::from(e.load.in_flight()))
        .sum();
    st.metrics.in_flight.set(in_flight);
    // Per endpoint: only the ready ones (endpoints that left drop out of the series).
    st.metrics.endpoint_in_flight.clear();
    for e in snap.endpoints.iter() {
        st.metrics
            .endpoint_in_flight
            .get_or_create(&crate::metrics::EndpointLabels {
                endpoint: e.addr_str.clone(),
            })
            .set(i64::from(e.load.in_flight()));
    }
    st.metrics.collect_tokenizers();
    if let Some(kv) = &st.kv {
        st.metrics.collect_prompt_hashes(kv.prompt_hash_stats());
        st.metrics.collect_pick_paths(kv.pick_paths());
    }
    st.metrics.runtime_alive_tasks.set(
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks() as i64,
    );
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.encode(),
    )
}

async fn ready(State(st): State<ApiState>) -> impl IntoResponse {
    if st.draining.as_ref().is_some_and(|d| *d.borrow()) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: shutting down\n".to_string(),
        );
    }
    if *st.store.ready().borrow() {
        (StatusCode::OK, "ready\n".to_string())
    } else {
        let t = st.store.target();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: InferencePool {}/{} not found or endpoints not synced yet (the log and kvepp_discovery_refused / kvepp_discovery_watch_errors_total say why)\n",
                t.namespace, t.name
            ),
        )
    }
}

/// `{"endpoints": {"<ip:port>": {"name": .., "blocks": [sequence hashes, sorted]}}}`: what the
/// KV-event index believes each ready endpoint caches (rank 0, or the endpoint's own rank), in the EPP's block hashes.
async fn kv_index(State(st): State<ApiState>) -> impl IntoResponse {
    let Some(kv) = &st.kv else {
        return (
            StatusCode::NOT_FOUND,
            "the KV-aware picker is not running (picker: kv-aware)\n".to_string(),
        );
    };
    let snap = st.store.snapshot();
    let index = kv.index().read();
    let mut out = serde_json::Map::new();
    for e in &snap.endpoints {
        let rank = WorkerRank {
            worker: e.worker,
            dp_rank: e.dp_rank.unwrap_or(0),
        };
        let blocks: Vec<u64> = index.rank_sequences(rank).iter().map(|h| h.0).collect();
        out.insert(
            e.addr_str.to_string(),
            serde_json::json!({"name": &*e.name, "blocks": blocks}),
        );
    }
    (
        StatusCode::OK,
        serde_json::json!({"block_size": kv.block_size(), "endpoints": out}).to_string(),
    )
}

/// `{"endpoints": [{"addr", "name", "role", "topology_domains", "data_parallel_rank",
/// "in_flight"}], "ttft_model", "decode_model"}`: the ready endpoints as the picker sees them
/// (roles and topology come from their `/metadata`) and what the predicted costs learned.
async fn endpoints(State(st): State<ApiState>) -> impl IntoResponse {
    let snap = st.store.snapshot();
    let now = std::time::Instant::now();
    let list: Vec<serde_json::Value> = snap
        .endpoints
        .iter()
        .map(|e| {
            serde_json::json!({"addr": &*e.addr_str, "name": &*e.name, "role": e.role.as_str(),
                "topology_domains": e.domains, "data_parallel_rank": e.dp_rank,
                "in_flight": e.load.in_flight(), "hidden_requests": e.load.hidden_requests(),
                "ttft_speed_factor": e.load.ttft.factor_at(now),
                "ttft_observed": e.load.ttft.observed(),
                "lora_adapters": e.load.adapters().map(|a| serde_json::json!({
                    "running": a.running.iter().map(|n| &**n).collect::<Vec<_>>(),
                    "waiting": a.waiting.iter().map(|n| &**n).collect::<Vec<_>>(),
                    "max_lora": a.max_lora, "from_metadata": a.from_metadata,
                    "scraped_ms_ago": e.load.saturation_inputs(now)
                        .map(|(_, _, age)| u64::try_from(age.as_millis()).unwrap_or(u64::MAX)),
                    "routed_recently": e.load.recent_adapters.load().iter()
                        .map(|n| &**n).collect::<Vec<_>>()}))})
        })
        .collect();
    let model = st.kv.as_ref().map(|kv| {
        let m = kv.ttft_model();
        let [base_ms, per_kprefill, per_kdecode, per_hidden] = m.coefficients();
        serde_json::json!({"observed": m.observed(), "base_ms": base_ms,
            "ms_per_1k_prefill_tokens": per_kprefill, "ms_per_1k_decoding_tokens": per_kdecode,
            "ms_per_hidden_request": per_hidden})
    });
    let decode = st.kv.as_ref().map(|kv| {
        let m = kv.decode_model();
        let [step_ms, per_request, per_kread] = m.coefficients();
        serde_json::json!({"observed": m.observed(), "ms_per_step": step_ms,
            "ms_per_step_per_request": per_request, "ms_per_step_per_1k_tokens_read": per_kread,
            "mean_output_tokens": m.lengths().pool_mean()})
    });
    axum::Json(
        serde_json::json!({ "endpoints": list, "ttft_model": model, "decode_model": decode }),
    )
}

/// The KV index snapshot another replica recovers from (`kvepp-index-dump/1`).
async fn dump(State(st): State<ApiState>) -> axum::response::Response {
    let Some(kv) = &st.kv else {
        return json::ApiError::new(
            StatusCode::NOT_FOUND,
            "the KV-aware picker is not running (picker: kv-aware)",
        )
        .into_response();
    };
    let doc = crate::replica::recovery::DumpDoc {
        format: crate::replica::recovery::FORMAT.into(),
        scopes: vec![crate::replica::recovery::scope_dump(
            &slot_tracker::pool_scope(),
            kv,
            st.router.as_ref().map(|r| r.sessions()),
        )],
    };
    axum::Json(doc).into_response()
}
