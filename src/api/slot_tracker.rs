//! `kvepp slot-tracker`: the standalone slot tracker's HTTP routes (Dynamo's
//! `dynamo.slot_tracker`, route for route and field for field) over the core's [`Catalog`].
//!
//! Owns: request/response shapes and statuses. Invariants: every answer is JSON except `GET
//! /health` (200, empty body); every error is `{"error": ...}`; request ids are scoped by (model,
//! tenant); sequence hashes arrive as signed or unsigned 64-bit integers and keep their bits; no
//! lock is held across an await.

use parking_lot::RwLock;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

use super::json::{
    default_tenant, ok, sequence_hashes, unknown_route, wrong_method, ApiError, Body, Hash64,
    ScopeFilter,
};
use crate::replica::peers::SharedPeers;
use kvepp_core::catalog::{Catalog, Origin, Scope, Worker};
use kvepp_core::slots::WorkerRank;

/// Shared by the routes (and by `kvepp serve` when it opens this door over its own state).
#[derive(Debug)]
pub struct SlotTrackerState {
    pub catalog: Arc<RwLock<Catalog>>,
    pub peers: Arc<SharedPeers>,
}

type St = State<Arc<SlotTrackerState>>;

/// Every route, (method, path): what `openapi/slot-tracker.yaml` documents (checked by a test).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/health"),
    ("POST", "/register"),
    ("POST", "/unregister"),
    ("GET", "/workers"),
    ("POST", "/add"),
    ("POST", "/prefill_complete"),
    ("POST", "/free"),
    ("GET", "/loads"),
    ("POST", "/potential_loads"),
    ("POST", "/register_peer"),
    ("POST", "/deregister_peer"),
    ("GET", "/peers"),
];

/// The OpenAPI document of these routes.
pub const OPENAPI: &str = include_str!("openapi/slot-tracker.yaml");

/// The service's routes; with a token in `access`, every route but GET ones needs it.
pub fn router(state: Arc<SlotTrackerState>, access: &crate::api::auth::Access) -> Router {
    let routes = Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/register", post(register))
        .route("/unregister", post(unregister))
        .route("/workers", get(workers))
        .route("/add", post(add))
        .route("/prefill_complete", post(prefill_complete))
        .route("/free", post(free))
        .route("/loads", get(loads))
        .route("/potential_loads", post(potential_loads))
        .route("/register_peer", post(register_peer))
        .route("/deregister_peer", post(deregister_peer))
        .route("/peers", get(peers))
        .with_state(state);
    access
        .guard(routes, crate::api::auth::Guarded::Writes)
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
}

#[derive(Debug, Deserialize)]
struct RegisterBody {
    worker_id: u64,
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    block_size: u32,
    #[serde(default)]
    dp_start: u32,
    #[serde(default = "one")]
    dp_size: u32,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Serialize)]
struct WorkerView<'a> {
    worker_id: u64,
    model_name: &'a str,
    tenant_id: &'a str,
    block_size: u32,
    dp_start: u32,
    dp_size: u32,
}

async fn register(State(st): St, Body(b): Body<RegisterBody>) -> Result<Response, ApiError> {
    let scope = Scope {
        model: b.model_name,
        tenant: b.tenant_id,
    };
    st.catalog.write().register(
        scope,
        Worker {
            worker_id: b.worker_id,
            block_size: b.block_size,
            dp_start: b.dp_start,
            dp_size: b.dp_size,
            endpoint: None,
            kv_events_endpoints: Default::default(),
            replay_endpoint: None,
        },
    )?;
    Ok(ok(StatusCode::CREATED))
}

#[derive(Debug, Deserialize)]
struct WorkerRef {
    worker_id: u64,
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
}

async fn unregister(State(st): St, Body(b): Body<WorkerRef>) -> Result<Response, ApiError> {
    let scope = Scope {
        model: b.model_name,
        tenant: b.tenant_id,
    };
    st.catalog
        .write()
        .unregister(&scope, b.worker_id)
        .map_err(|_| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "worker {} is not registered for model {:?} tenant {:?}",
                    b.worker_id, scope.model, scope.tenant
                ),
            )
        })?;
    Ok(ok(StatusCode::OK))
}

async fn workers(State(st): St, RawQuery(q): RawQuery) -> Response {
    let filter = ScopeFilter::parse(q.as_deref());
    let catalog = st.catalog.read();
    let pool = pool_scope();
    let list: Vec<WorkerView<'_>> = catalog
        .trackers(&pool)
        .filter(|(s, _)| filter.admits(s))
        .flat_map(|(s, t)| {
            t.workers.values().map(move |w| WorkerView {
                worker_id: w.worker_id,
                model_name: &s.model,
                tenant_id: &s.tenant,
                block_size: w.block_size,
                dp_start: w.dp_start,
                dp_size: w.dp_size,
            })
        })
        .collect();
    Json(list).into_response()
}

/// The scope `kvepp serve`'s pooled catalog is listed under.
pub(crate) fn pool_scope() -> Scope {
    Scope {
        model: "default".into(),
        tenant: "default".into(),
    }
}

#[derive(Debug, Deserialize)]
struct AddBody {
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    request_id: String,
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
    sequence_hashes: Vec<Hash64>,
    #[serde(default)]
    new_isl_tokens: u64,
}

async fn add(State(st): St, Body(b): Body<AddBody>) -> Result<Response, ApiError> {
    let scope = Scope {
        model: b.model_name,
        tenant: b.tenant_id,
    };
    let hashes = sequence_hashes(&b.sequence_hashes);
    let rank = WorkerRank {
        worker: b.worker_id,
        dp_rank: b.dp_rank,
    };
    st.catalog.read().add_scoped(
        &scope,
        &b.request_id,
        rank,
        &hashes,
        b.new_isl_tokens,
        Instant::now(),
    )?;
    Ok(ok(StatusCode::CREATED))
}

#[derive(Debug, Deserialize)]
struct RequestRef {
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    request_id: String,
}

impl RequestRef {
    fn scope(&self) -> Scope {
        Scope {
            model: self.model_name.clone(),
            tenant: self.tenant_id.clone(),
        }
    }
}

async fn prefill_complete(State(st): St, Body(b): Body<RequestRef>) -> Result<Response, ApiError> {
    let catalog = st.catalog.read();
    let scope = b.scope();
    catalog.tracker(&scope)?;
    catalog.prefill_complete_by(Some(&scope), &b.request_id, Origin::Client)?;
    Ok(ok(StatusCode::OK))
}

async fn free(State(st): St, Body(b): Body<RequestRef>) -> Result<Response, ApiError> {
    let catalog = st.catalog.read();
    let scope = b.scope();
    catalog.tracker(&scope)?;
    // Freeing an unknown request is not an error (the slot tracker's contract).
    catalog.free_by(Some(&scope), &b.request_id, Origin::Client);
    Ok(ok(StatusCode::OK))
}

#[derive(Debug, Serialize)]
struct LoadView<'a> {
    model_name: &'a str,
    tenant_id: &'a str,
    worker_id: u64,
    dp_rank: u32,
    active_prefill_tokens: u64,
    active_decode_blocks: u64,
}

/// Loads of every rank the filter admits, sorted by (model, tenant, worker, rank).
pub(crate) fn load_rows(catalog: &Catalog, filter: &ScopeFilter) -> serde_json::Value {
    let pool = pool_scope();
    let rows: Vec<LoadView<'_>> = catalog
        .trackers(&pool)
        .filter(|(s, _)| filter.admits(s))
        .flat_map(|(s, t)| {
            catalog.loads(t).into_iter().map(move |(r, l)| LoadView {
                model_name: &s.model,
                tenant_id: &s.tenant,
                worker_id: r.worker,
                dp_rank: r.dp_rank,
                active_prefill_tokens: l.active_prefill_tokens,
                active_decode_blocks: l.active_decode_blocks,
            })
        })
        .collect();
    serde_json::to_value(rows).unwrap_or_default()
}

async fn loads(State(st): St, RawQuery(q): RawQuery) -> Response {
    let filter = ScopeFilter::parse(q.as_deref());
    Json(load_rows(&st.catalog.read(), &filter)).into_response()
}

#[derive(Debug, Deserialize)]
struct PotentialBody {
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    sequence_hashes: Vec<Hash64>,
    #[serde(default)]
    new_isl_tokens: u64,
}

#[derive(Debug, Serialize)]
pub struct PotentialView {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub potential_prefill_tokens: u64,
    pub potential_decode_blocks: u64,
    pub active_requests: u32,
}

pub(crate) fn potential_rows(loads: Vec<kvepp_core::slots::PotentialLoad>) -> Vec<PotentialView> {
    loads
        .into_iter()
        .map(|p| PotentialView {
            worker_id: p.rank.worker,
            dp_rank: p.rank.dp_rank,
            potential_prefill_tokens: p.potential_prefill_tokens,
            potential_decode_blocks: p.potential_decode_blocks,
            active_requests: p.active_requests,
        })
        .collect()
}

async fn potential_loads(
    State(st): St,
    Body(b): Body<PotentialBody>,
) -> Result<Response, ApiError> {
    let scope = Scope {
        model: b.model_name,
        tenant: b.tenant_id,
    };
    let hashes = sequence_hashes(&b.sequence_hashes);
    let loads = st.catalog.read().potential_loads(
        &scope,
        kvepp_core::catalog::PromptRef {
            hashes: &hashes,
            isl_tokens: b.new_isl_tokens,
        },
    )?;
    Ok(Json(potential_rows(loads)).into_response())
}

#[derive(Debug, Deserialize)]
struct PeerBody {
    url: String,
}

async fn register_peer(State(st): St, Body(b): Body<PeerBody>) -> Result<Response, ApiError> {
    st.peers.register(&b.url)?;
    Ok(ok(StatusCode::OK))
}

async fn deregister_peer(State(st): St, Body(b): Body<PeerBody>) -> Result<Response, ApiError> {
    st.peers.deregister(&b.url)?;
    Ok(ok(StatusCode::OK))
}

async fn peers(State(st): St) -> Response {
    Json(st.peers.list()).into_response()
}
