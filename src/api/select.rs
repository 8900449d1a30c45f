//! `kvepp select-service`: the standalone selection service's HTTP routes (Dynamo's
//! `dynamo.select_service`, route for route and field for field) over the core's [`Catalog`].
//!
//! Owns: request/response shapes, statuses, reservation-id generation, and publishing the set of
//! KV-event subscriptions the registered workers ask for. Invariants: every error is
//! `{"error": ...}`; overlap values are matched tokens (blocks × the scope's block size); ids that
//! are absent are omitted from answers; `effective_prefill_tokens` above the input length is
//! refused; no lock is held across an await.

use parking_lot::{Mutex, RwLock};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::json::{
    default_model, default_tenant, ok, sequence_hashes, unknown_route, wrong_method, ApiError,
    Body, Hash64, ScopeFilter,
};
use super::slot_tracker::{load_rows, pool_scope, potential_rows};
use crate::kv_events::apply::Subscribe;
use crate::kv_events::Source;
use crate::replica::peers::SharedPeers;
use kvepp_core::affinity::{SessionIdError, SessionKey};
use kvepp_core::catalog::{Catalog, CatalogError, PromptRef, Scope, Selection, Tracker, Worker};
use kvepp_core::cost::Overlap;
use kvepp_core::hash::{sequence_hashes as chain_locals, LocalBlockHash};
use kvepp_core::slots::WorkerRank;
use kvepp_core::SequenceHash;

#[derive(Debug)]
pub struct SelectState {
    pub catalog: Arc<RwLock<Catalog>>,
    pub peers: Arc<SharedPeers>,
    /// The KV-event subscriptions the registered workers ask for (consumed by
    /// [`crate::kv_events::apply::run_registered`]).
    pub subscriptions: watch::Sender<Vec<Subscribe>>,
    rng: Mutex<fastrand::Rng>,
    id_prefix: u64,
    next_id: AtomicU64,
}

impl SelectState {
    pub fn new(catalog: Arc<RwLock<Catalog>>, peers: Arc<SharedPeers>) -> Self {
        let mut rng = fastrand::Rng::new();
        SelectState {
            catalog,
            peers,
            subscriptions: watch::channel(Vec::new()).0,
            id_prefix: rng.u64(..),
            rng: Mutex::new(rng),
            next_id: AtomicU64::new(0),
        }
    }

    /// Publishes the subscriptions of every registered worker rank that names a publisher.
    fn publish_subscriptions(&self, catalog: &Catalog) {
        let pool = pool_scope();
        let mut set = Vec::new();
        for (scope, t) in catalog.trackers(&pool) {
            for w in t.workers.values() {
                let first = w.kv_events_endpoints.keys().next().copied();
                for (&rank, endpoint) in &w.kv_events_endpoints {
                    set.push(Subscribe {
                        kv: t.kv.clone(),
                        worker: w.worker_id,
                        rank,
                        label: format!("{}/{}/{}/{}", scope.model, scope.tenant, w.worker_id, rank)
                            .into(),
                        source: Source {
                            endpoint: endpoint.clone(),
                            // One replay socket per worker: it answers for its first rank.
                            replay_endpoint: w
                                .replay_endpoint
                                .clone()
                                .filter(|_| Some(rank) == first),
                            topic: String::new(),
                        },
                    });
                }
            }
        }
        self.subscriptions.send_replace(set);
    }

    fn new_reservation_id(&self) -> String {
        format!(
            "res-{:016x}-{}",
            self.id_prefix,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }
}

type St = State<Arc<SelectState>>;

/// Every route, (method, path): what `openapi/select-service.yaml` documents (checked by a test).
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/health"),
    ("GET", "/ready"),
    ("POST", "/workers"),
    ("GET", "/workers"),
    ("PATCH", "/workers/{worker_id}"),
    ("DELETE", "/workers/{worker_id}"),
    ("POST", "/select"),
    ("POST", "/select_and_reserve"),
    ("POST", "/reservations"),
    ("DELETE", "/reservations/{reservation_id}"),
    ("POST", "/reservations/{reservation_id}/prefill_complete"),
    ("POST", "/reservations/{reservation_id}/output_block"),
    ("GET", "/loads"),
    ("POST", "/potential_loads"),
    ("POST", "/overlap_scores"),
    ("GET", "/dump"),
    ("POST", "/replica_sync/register_peer"),
    ("POST", "/replica_sync/deregister_peer"),
    ("GET", "/replica_sync/peers"),
];

/// The OpenAPI document of these routes.
pub const OPENAPI: &str = include_str!("openapi/select-service.yaml");

/// The service's routes; with a token in `access`, every route but GET ones needs it.
pub fn router(state: Arc<SelectState>, access: &crate::api::auth::Access) -> Router {
    let routes = Router::new()
        .route("/health", get(|| async { ok(StatusCode::OK) }))
        .route("/ready", get(ready))
        .route("/workers", post(add_worker).get(list_workers))
        .route(
            "/workers/{worker_id}",
            axum::routing::patch(patch_worker).delete(delete_worker),
        )
        .route("/select", post(select))
        .route("/select_and_reserve", post(select_and_reserve))
        .route("/reservations", post(reserve))
        .route(
            "/reservations/{reservation_id}",
            axum::routing::delete(free),
        )
        .route(
            "/reservations/{reservation_id}/prefill_complete",
            post(prefill_complete),
        )
        .route(
            "/reservations/{reservation_id}/output_block",
            post(output_block),
        )
        .route("/loads", get(loads))
        .route("/potential_loads", post(potential_loads))
        .route("/overlap_scores", post(overlap_scores))
        .route("/dump", get(dump))
        .route("/replica_sync/register_peer", post(register_peer))
        .route("/replica_sync/deregister_peer", post(deregister_peer))
        .route("/replica_sync/peers", get(peers))
        .with_state(state);
    access
        .guard(routes, crate::api::auth::Guarded::Writes)
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
}

// ------------------------------------------------------------------------------------- workers

#[derive(Debug, Deserialize)]
struct WorkerBody {
    worker_id: u64,
    #[serde(default = "default_model")]
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    endpoint: Option<String>,
    #[serde(default = "default_block_size")]
    block_size: u32,
    #[serde(default)]
    data_parallel_start_rank: u32,
    #[serde(default = "one")]
    data_parallel_size: u32,
    #[serde(default)]
    kv_events_endpoints: BTreeMap<u32, String>,
    replay_endpoint: Option<String>,
}

fn default_block_size() -> u32 {
    kvepp_core::types::DEFAULT_BLOCK_SIZE
}

fn one() -> u32 {
    1
}

/// PATCH body: every field optional; `model_name`/`tenant_id` narrow which registrations change.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchBody {
    model_name: Option<String>,
    tenant_id: Option<String>,
    endpoint: Option<String>,
    block_size: Option<u32>,
    data_parallel_start_rank: Option<u32>,
    data_parallel_size: Option<u32>,
    kv_events_endpoints: Option<BTreeMap<u32, String>>,
    replay_endpoint: Option<String>,
}

#[derive(Debug, Serialize)]
struct WorkerView<'a> {
    worker_id: u64,
    model_name: &'a str,
    tenant_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    endpoint: Option<&'a str>,
    block_size: u32,
    data_parallel_start_rank: u32,
    data_parallel_size: u32,
    kv_events_endpoints: BTreeMap<String, &'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    replay_endpoint: Option<&'a str>,
}

fn worker_view<'a>(scope: &'a Scope, w: &'a Worker) -> WorkerView<'a> {
    WorkerView {
        worker_id: w.worker_id,
        model_name: &scope.model,
        tenant_id: &scope.tenant,
        endpoint: w.endpoint.as_deref(),
        block_size: w.block_size,
        data_parallel_start_rank: w.dp_start,
        data_parallel_size: w.dp_size,
        kv_events_endpoints: w
            .kv_events_endpoints
            .iter()
            .map(|(r, e)| (r.to_string(), e.as_str()))
            .collect(),
        replay_endpoint: w.replay_endpoint.as_deref(),
    }
}

fn check_zmq(w: &Worker) -> Result<(), ApiError> {
    for (rank, e) in &w.kv_events_endpoints {
        if !w.has_rank(*rank) {
            return Err(ApiError::bad_request(format!(
                "kv_events_endpoints names rank {rank}, outside the worker's data-parallel range"
            )));
        }
        crate::replica::peers::validate_endpoint(e).map_err(ApiError::bad_request)?;
    }
    if let Some(e) = &w.replay_endpoint {
        crate::replica::peers::validate_endpoint(e).map_err(ApiError::bad_request)?;
    }
    Ok(())
}

async fn add_worker(State(st): St, Body(b): Body<WorkerBody>) -> Result<Response, ApiError> {
    let scope = Scope {
        model: b.model_name,
        tenant: b.tenant_id,
    };
    let worker = Worker {
        worker_id: b.worker_id,
        block_size: b.block_size,
        dp_start: b.data_parallel_start_rank,
        dp_size: b.data_parallel_size,
        endpoint: b.endpoint,
        kv_events_endpoints: b.kv_events_endpoints,
        replay_endpoint: b.replay_endpoint,
    };
    check_zmq(&worker)?;
    let mut catalog = st.catalog.write();
    catalog.register(scope.clone(), worker.clone())?;
    st.publish_subscriptions(&catalog);
    tracing::info!(worker = worker.worker_id, model = %scope.model, tenant = %scope.tenant, "worker registered");
    Ok((StatusCode::CREATED, Json(worker_view(&scope, &worker))).into_response())
}

async fn list_workers(State(st): St, RawQuery(q): RawQuery) -> Response {
    let filter = ScopeFilter::parse(q.as_deref());
    let catalog = st.catalog.read();
    let pool = pool_scope();
    let list: Vec<WorkerView<'_>> = catalog
        .trackers(&pool)
        .filter(|(s, _)| filter.admits(s))
        .flat_map(|(s, t)| t.workers.values().map(move |w| worker_view(s, w)))
        .collect();
    Json(list).into_response()
}

fn matching_scopes(
    catalog: &Catalog,
    worker_id: u64,
    filter: &ScopeFilter,
) -> Result<Vec<Scope>, ApiError> {
    if catalog.is_pooled() {
        return Err(CatalogError::Pooled.into());
    }
    let scopes: Vec<Scope> = catalog
        .scopes_of(worker_id)
        .into_iter()
        .filter(|s| filter.admits(s))
        .collect();
    if scopes.is_empty() {
        return Err(CatalogError::UnknownWorker(worker_id).into());
    }
    Ok(scopes)
}

async fn patch_worker(
    State(st): St,
    Path(worker_id): Path<u64>,
    Body(b): Body<PatchBody>,
) -> Result<Response, ApiError> {
    let filter = ScopeFilter {
        model: b.model_name.clone(),
        tenant: b.tenant_id.clone(),
    };
    let mut catalog = st.catalog.write();
    let scopes = matching_scopes(&catalog, worker_id, &filter)?;
    let mut updated = Vec::new();
    for scope in scopes {
        let Some(old) = catalog
            .tracker(&scope)
            .ok()
            .and_then(|t| t.workers.get(&worker_id).cloned())
        else {
            continue;
        };
        let w = Worker {
            worker_id,
            block_size: b.block_size.unwrap_or(old.block_size),
            dp_start: b.data_parallel_start_rank.unwrap_or(old.dp_start),
            dp_size: b.data_parallel_size.unwrap_or(old.dp_size),
            endpoint: b.endpoint.clone().or(old.endpoint),
            kv_events_endpoints: b
                .kv_events_endpoints
                .clone()
                .unwrap_or(old.kv_events_endpoints),
            replay_endpoint: b.replay_endpoint.clone().or(old.replay_endpoint),
        };
        check_zmq(&w)?;
        catalog.register(scope.clone(), w.clone())?;
        updated.push((scope, w));
    }
    st.publish_subscriptions(&catalog);
    let views: Vec<WorkerView<'_>> = updated.iter().map(|(s, w)| worker_view(s, w)).collect();
    Ok(match views.len() {
        1 => Json(&views[0]).into_response(),
        _ => Json(&views).into_response(),
    })
}

async fn delete_worker(
    State(st): St,
    Path(worker_id): Path<u64>,
    RawQuery(q): RawQuery,
) -> Result<Response, ApiError> {
    let filter = ScopeFilter::parse(q.as_deref());
    let mut catalog = st.catalog.write();
    for scope in matching_scopes(&catalog, worker_id, &filter)? {
        catalog.unregister(&scope, worker_id)?;
    }
    st.publish_subscriptions(&catalog);
    tracing::info!(worker = worker_id, "worker removed");
    Ok(ok(StatusCode::OK))
}

async fn ready(State(st): St) -> Response {
    let catalog = st.catalog.read();
    let pool = pool_scope();
    let workers = catalog.worker_count();
    let ranks: usize = catalog.trackers(&pool).map(|(_, t)| t.ranks().len()).sum();
    let subscriptions = st.subscriptions.borrow().len();
    let details = |status: &str| {
        serde_json::json!({
            "status": status,
            "workers": workers,
            "schedulable_ranks": ranks,
            "scopes": catalog.trackers(&pool).count(),
            "kv_event_subscriptions": subscriptions,
        })
    };
    if ranks > 0 {
        (StatusCode::OK, Json(details("ready"))).into_response()
    } else {
        let mut body = details("not_ready");
        body["error"] = "no schedulable worker is registered (POST /workers)".into();
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}

// ----------------------------------------------------------------------------------- selection

/// A prompt as the selection routes take it (local block hashes and/or their chained sequence
/// hashes, and the input length), with the fields only some routes read: one flat struct, so a
/// 32k-token prompt's hashes are parsed once, straight into place (serde's `flatten` would buffer
/// the whole body first). Fields a route requires are checked by [`required`].
#[derive(Debug, Deserialize)]
struct PromptBody {
    selection_id: Option<String>,
    reservation_id: Option<String>,
    worker_id: Option<u64>,
    dp_rank: Option<u32>,
    effective_prefill_tokens: Option<u64>,
    #[serde(default = "default_model")]
    model_name: String,
    #[serde(default = "default_tenant")]
    tenant_id: String,
    block_hashes: Option<Vec<Hash64>>,
    sequence_hashes: Option<Vec<Hash64>>,
    isl_tokens: Option<u64>,
    session_id: Option<String>,
}

impl PromptBody {
    /// The request's session: None without one; `Err` for an unusable id (logged; the request is
    /// selected without a session).
    fn session(&self) -> Option<Result<SessionKey, SessionIdError>> {
        let id = self.session_id.as_deref()?;
        let key = SessionKey::parse(id.as_bytes());
        if let Err(e) = &key {
            tracing::warn!(error = %e, "session_id ignored; selected without a session");
        }
        Some(key)
    }

    fn scope(&self) -> Scope {
        Scope {
            model: self.model_name.clone(),
            tenant: self.tenant_id.clone(),
        }
    }

    /// The sequence hashes (chained from the block hashes when only those are given) and the
    /// normalized input length (blocks × block size when not given).
    fn prompt(&self, block_size: u32) -> Result<(Vec<SequenceHash>, u64), ApiError> {
        let hashes = match (&self.sequence_hashes, &self.block_hashes) {
            (Some(s), Some(b)) if s.len() != b.len() => {
                return Err(ApiError::bad_request(format!(
                    "sequence_hashes has {} entries and block_hashes {}",
                    s.len(),
                    b.len()
                )))
            }
            (Some(s), _) => sequence_hashes(s),
            (None, Some(b)) => {
                let locals: Vec<LocalBlockHash> = b.iter().map(|h| LocalBlockHash(h.0)).collect();
                chain_locals(&locals)
            }
            (None, None) => Vec::new(),
        };
        let isl = self
            .isl_tokens
            .unwrap_or(hashes.len() as u64 * u64::from(block_size));
        Ok((hashes, isl))
    }
}

/// A field the route requires (the answer serde would give, 422).
fn required<T>(v: Option<T>, field: &str) -> Result<T, ApiError> {
    v.ok_or_else(|| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("missing field `{field}`"),
        )
    })
}

#[derive(Debug, Serialize)]
struct OverlapView {
    longest_matched: u64,
    gpu: u64,
    dp: BTreeMap<String, u64>,
    cpu: u64,
    disk: u64,
}

#[derive(Debug, Serialize)]
struct SelectionView {
    #[serde(skip_serializing_if = "Option::is_none")]
    selection_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reservation_id: Option<String>,
    model_name: String,
    tenant_id: String,
    worker_id: u64,
    dp_rank: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    endpoint: Option<String>,
    block_size: u32,
    overlap: OverlapView,
    effective_prefill_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<&'static str>,
}

fn selection_view(
    s: Selection,
    scope: Scope,
    selection_id: Option<String>,
    reservation_id: Option<String>,
) -> SelectionView {
    let bs = u64::from(s.block_size);
    let o = s.choice.overlap;
    let mut dp: BTreeMap<String, u64> = s
        .per_rank
        .iter()
        .filter(|(r, ov)| ov.device > 0 || **r == s.choice.rank.dp_rank)
        .map(|(r, ov)| (r.to_string(), ov.device * bs))
        .collect();
    dp.entry(s.choice.rank.dp_rank.to_string()).or_insert(0);
    let longest = s.per_rank.values().map(|ov| ov.disk).max().unwrap_or(0);
    SelectionView {
        selection_id,
        reservation_id,
        model_name: scope.model,
        tenant_id: scope.tenant,
        worker_id: s.worker.worker_id,
        dp_rank: s.choice.rank.dp_rank,
        endpoint: s.worker.endpoint,
        block_size: s.block_size,
        overlap: OverlapView {
            longest_matched: longest.max(o.disk) * bs,
            gpu: o.device * bs,
            dp,
            cpu: o.host * bs,
            disk: o.disk * bs,
        },
        effective_prefill_tokens: s.choice.effective_prefill_tokens,
        session: None,
    }
}

fn do_select(st: &SelectState, b: PromptBody, reserve: bool) -> Result<Response, ApiError> {
    let scope = b.scope();
    let catalog = st.catalog.read();
    let bs = catalog.tracker(&scope)?.block_size();
    let (hashes, isl) = b.prompt(bs)?;
    let session = b.session();
    let reservation_id = match (reserve, b.reservation_id) {
        (true, Some(id)) => Some(id),
        (true, None) => Some(st.new_reservation_id()),
        (false, id) => id,
    };
    let booking = reservation_id
        .as_deref()
        .filter(|_| reserve)
        .map(|id| (id, Instant::now()));
    let selection = {
        let mut rng = st.rng.lock();
        catalog.select_in_session(
            &scope,
            PromptRef {
                hashes: &hashes,
                isl_tokens: isl,
            },
            session.as_ref().and_then(|s| s.as_ref().ok().copied()),
            booking,
            &mut rng,
        )?
    };
    let outcome = match session {
        None => None,
        Some(Err(_)) => Some("ignored"),
        Some(Ok(_)) => selection.session.map(|s| s.as_str()),
    };
    let mut view = selection_view(selection, scope, b.selection_id, reservation_id);
    view.session = outcome;
    Ok(Json(view).into_response())
}

async fn select(State(st): St, Body(b): Body<PromptBody>) -> Result<Response, ApiError> {
    do_select(&st, b, false)
}

async fn select_and_reserve(
    State(st): St,
    Body(b): Body<PromptBody>,
) -> Result<Response, ApiError> {
    do_select(&st, b, true)
}

// -------------------------------------------------------------------------------- reservations

async fn reserve(State(st): St, Body(b): Body<PromptBody>) -> Result<Response, ApiError> {
    let id = required(b.reservation_id.clone(), "reservation_id")?;
    let worker = required(b.worker_id, "worker_id")?;
    let scope = b.scope();
    let catalog = st.catalog.read();
    let bs = catalog.tracker(&scope)?.block_size();
    let (hashes, isl) = b.prompt(bs)?;
    let rank = WorkerRank {
        worker,
        dp_rank: b.dp_rank.unwrap_or(0),
    };
    catalog.reserve(
        &scope,
        &id,
        rank,
        PromptRef {
            hashes: &hashes,
            isl_tokens: isl,
        },
        b.effective_prefill_tokens,
        Instant::now(),
    )?;
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({"status": "ok", "reservation_id": id})),
    )
        .into_response())
}

async fn prefill_complete(State(st): St, Path(id): Path<String>) -> Result<Response, ApiError> {
    st.catalog.read().prefill_complete(&id)?;
    Ok(ok(StatusCode::OK))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct OutputBlockBody {
    decay_fraction: Option<f64>,
}

/// The body is optional: empty, or `{"decay_fraction": x}` with x in [0, 1].
async fn output_block(
    State(st): St,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let decay = if body.iter().all(u8::is_ascii_whitespace) {
        None
    } else {
        let b: OutputBlockBody = serde_json::from_slice(&body).map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("invalid body: {e}"),
            )
        })?;
        b.decay_fraction
    };
    if let Some(d) = decay {
        if !(0.0..=1.0).contains(&d) {
            return Err(ApiError::bad_request(format!(
                "decay_fraction {d} is outside [0.0, 1.0]"
            )));
        }
    }
    st.catalog.read().output_block(&id, decay)?;
    Ok(ok(StatusCode::OK))
}

async fn free(State(st): St, Path(id): Path<String>) -> Result<Response, ApiError> {
    if st.catalog.read().free(&id) {
        Ok(ok(StatusCode::OK))
    } else {
        Err(CatalogError::UnknownReservation(id).into())
    }
}

// ---------------------------------------------------------------------------------- inspection

async fn loads(State(st): St, RawQuery(q): RawQuery) -> Response {
    let filter = ScopeFilter::parse(q.as_deref());
    Json(load_rows(&st.catalog.read(), &filter)).into_response()
}

async fn potential_loads(State(st): St, Body(b): Body<PromptBody>) -> Result<Response, ApiError> {
    let scope = b.scope();
    let catalog = st.catalog.read();
    let bs = catalog.tracker(&scope)?.block_size();
    let (hashes, isl) = b.prompt(bs)?;
    let loads = catalog.potential_loads(
        &scope,
        PromptRef {
            hashes: &hashes,
            isl_tokens: isl,
        },
    )?;
    Ok(Json(potential_rows(loads)).into_response())
}

#[derive(Debug, Serialize)]
struct OverlapRow {
    worker_id: u64,
    dp_rank: u32,
    longest_matched: u64,
    gpu: u64,
    cpu: u64,
    disk: u64,
}

fn overlap_rows(t: &Tracker, hashes: &[SequenceHash]) -> Vec<OverlapRow> {
    let bs = u64::from(t.block_size());
    let found = t.kv.rank_overlaps(hashes);
    t.ranks()
        .into_iter()
        .map(|r| {
            let o = found
                .iter()
                .find(|o| o.rank == r)
                .map_or(Overlap::default(), |o| o.overlap);
            OverlapRow {
                worker_id: r.worker,
                dp_rank: r.dp_rank,
                longest_matched: o.disk * bs,
                gpu: o.device * bs,
                cpu: o.host * bs,
                disk: o.disk * bs,
            }
        })
        .collect()
}

async fn overlap_scores(State(st): St, Body(b): Body<PromptBody>) -> Result<Response, ApiError> {
    let scope = b.scope();
    let catalog = st.catalog.read();
    let t = catalog.tracker(&scope)?;
    let (hashes, _) = b.prompt(t.block_size())?;
    Ok(Json(overlap_rows(t, &hashes)).into_response())
}

/// The index snapshot a peer recovers from ([`crate::replica::recovery`]).
async fn dump(State(st): St) -> Response {
    let catalog = st.catalog.read();
    Json(crate::replica::recovery::dump(&catalog, &pool_scope())).into_response()
}

// -------------------------------------------------------------------------------- replica sync

#[derive(Debug, Deserialize)]
struct PeerBody {
    endpoint: String,
}

async fn register_peer(State(st): St, Body(b): Body<PeerBody>) -> Result<Response, ApiError> {
    st.peers.register(&b.endpoint)?;
    Ok(ok(StatusCode::OK))
}

async fn deregister_peer(State(st): St, Body(b): Body<PeerBody>) -> Result<Response, ApiError> {
    st.peers.deregister(&b.endpoint)?;
    Ok(ok(StatusCode::OK))
}

async fn peers(State(st): St) -> Response {
    Json(st.peers.list()).into_response()
}
