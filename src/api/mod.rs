//! HTTP services beside the gRPC ones: Prometheus `/metrics`, liveness `/health`, readiness `/ready`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::discovery::Datastore;
use crate::metrics::Metrics;

#[derive(Debug, Clone)]
pub struct ApiState {
    pub metrics: Arc<Metrics>,
    pub store: Arc<Datastore>,
}

pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { "ok\n" }))
        .route("/ready", get(ready))
        .with_state(state)
}

async fn metrics(State(st): State<ApiState>) -> impl IntoResponse {
    let snap = st.store.snapshot();
    let in_flight: i64 = snap
        .endpoints
        .iter()
        .map(|e| i64::from(e.load.in_flight()))
        .sum();
    st.metrics.in_flight.set(in_flight);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        st.metrics.encode(),
    )
}

async fn ready(State(st): State<ApiState>) -> impl IntoResponse {
    if *st.store.ready().borrow() {
        (StatusCode::OK, "ready\n".to_string())
    } else {
        let t = st.store.target();
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: InferencePool {}/{} not found or endpoints not synced yet\n",
                t.namespace, t.name
            ),
        )
    }
}
