//! The fuzz targets: one function per input kvepp takes from the network or the disk. Each runs
//! the real code on arbitrary bytes and checks what must hold for every input (beyond "does not
//! panic"), so a wrong answer is a crash too:
//!
//! - [`request_body`]: an ext_proc stream carrying the bytes as a request body, split into chunks
//!   anywhere (the split is drawn from the first byte). The decision (status or destination) and
//!   the body streamed back must not depend on the split, and BUFFERED must decide as streaming.
//! - [`kv_events`]: the vLLM KV-event decoder (msgpack), then the index update with what decoded.
//! - [`manifests`]: the Kubernetes YAML loader, then the datastore built from what parsed.
//! - [`http_json`]: the selection service's and slot tracker's routes (method and route from the
//!   first byte, the rest as the JSON body): only documented statuses, JSON errors.
//! - [`replica_sync`]: the replica-sync decoder applied to a catalog: exactly one outcome counted
//!   per message.
//!
//! cargo-fuzz runs them from `crates/kvepp-fuzz` (nightly, libFuzzer); this crate's test replays
//! the saved corpora through them on stable (`tests/corpus.rs`).

use parking_lot::RwLock;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use kvepp::discovery::objects::parse_documents;
use kvepp::discovery::{Datastore, Inventory, PoolRef};
use kvepp::extproc::wire::{
    body_mutation::Mutation, processing_request::Request as Req,
    processing_response::Response as Resp, CommonResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use kvepp::extproc::{Settings, Shared};
use kvepp::routing::RequestRouter;
use kvepp_core::catalog::{Catalog, Limits, Scope, Worker};
use kvepp_core::{KvSettings, KvState, Router, Saturation};

/// A target: arbitrary bytes in, a panic when something that must hold does not.
pub type Target = fn(&[u8]);

/// Every target by name, as the corpus folders are named.
pub const ALL: &[(&str, Target)] = &[
    ("request_body", request_body),
    ("kv_events", kv_events),
    ("manifests", manifests),
    ("http_json", http_json),
    ("replica_sync", replica_sync),
];

// ------------------------------------------------------------------------------- request_body

const BUFFERED: i32 = 2;
const DUPLEX: i32 = 4;
/// Small, so that oversized bodies (413) are reached too.
const MAX_BODY: usize = 2048;
const DESTINATION: &str = "x-gateway-destination-endpoint";

const POOL: &str = "apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferencePool
metadata: {name: pool}
spec: {targetPortNumber: 8000, selector: {app: test}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: m}
spec: {modelName: m, criticality: Standard, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModel
metadata: {name: rw}
spec: {modelName: rw, criticality: Sheddable, poolRef: {name: pool}, targetModels: [{name: rw-target, weight: 1}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: a, labels: {kubernetes.io/service-name: pool}}
addressType: IPv4
endpoints:
- addresses: [\"10.0.0.1\"]
  conditions: {ready: true}
  targetRef: {kind: Pod, name: a}
ports: [{name: http, port: 8000}]
";

fn pool_ref() -> PoolRef {
    PoolRef {
        name: "pool".into(),
        namespace: "default".into(),
        service: "pool".into(),
        picker_service: None,
    }
}

/// A pool with one endpoint behind the approximate-prefix picker (it hashes the prompt).
fn shared() -> Arc<Shared> {
    static SHARED: OnceLock<Arc<Shared>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let store = Arc::new(Datastore::new(pool_ref(), |_| {}));
            let objects = parse_documents(POOL.as_bytes()).unwrap_or_default();
            store.apply(&Inventory { objects });
            let kv = Arc::new(KvState::new(KvSettings {
                approximate_only: true,
                approx_blocks_per_endpoint: 256,
                ..KvSettings::default()
            }));
            let router = Arc::new(Router::kv_aware(kv, Saturation::in_flight(0)));
            let routing = RequestRouter::new(store, router, false);
            Arc::new(Shared::new(
                Arc::new(routing),
                kvepp::metrics::Metrics::new(),
                Settings {
                    destination_list: false,
                    max_body_bytes: MAX_BODY,
                    ready_wait: std::time::Duration::ZERO,
                    endpoint_scores: false,
                },
            ))
        })
        .clone()
}

fn headers(mode: i32, body_len: usize) -> ProcessingRequest {
    let h = |k: &str, v: &[u8]| HeaderValue {
        key: k.into(),
        raw_value: v.to_vec(),
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(Req::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    h(":method", b"POST"),
                    h(":path", b"/v1/completions"),
                    h("content-type", b"application/json"),
                    h("content-length", body_len.to_string().as_bytes()),
                ],
            }),
            end_of_stream: false,
            ..Default::default()
        })),
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode,
            response_body_mode: DUPLEX,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Req::RequestBody(HttpBody {
            body: bytes.to_vec().into(),
            end_of_stream,
        })),
        ..Default::default()
    }
}

/// What a stream's answers amount to: the immediate status (if any), the destination, and the
/// body handed back to the proxy.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    status: Option<i32>,
    destination: Option<String>,
    body: Vec<u8>,
}

fn common(r: &ProcessingResponse) -> Option<&CommonResponse> {
    match r.response.as_ref()? {
        Resp::RequestHeaders(h) => h.response.as_ref(),
        Resp::RequestBody(b) => b.response.as_ref(),
        _ => None,
    }
}

fn outcome(answers: &[ProcessingResponse]) -> Outcome {
    let mut o = Outcome {
        status: None,
        destination: None,
        body: Vec::new(),
    };
    for r in answers {
        if let Some(Resp::ImmediateResponse(i)) = &r.response {
            o.status = Some(i.status.as_ref().map_or(0, |s| s.code));
        }
        let Some(c) = common(r) else { continue };
        for set in c.header_mutation.iter().flat_map(|m| &m.set_headers) {
            if let Some(h) = set.header.as_ref().filter(|h| h.key == DESTINATION) {
                o.destination = Some(String::from_utf8_lossy(&h.raw_value).into_owned());
            }
        }
        match c.body_mutation.as_ref().and_then(|m| m.mutation.as_ref()) {
            Some(Mutation::StreamedResponse(s)) => o.body.extend_from_slice(&s.body),
            Some(Mutation::Body(b)) => o.body.extend_from_slice(b),
            _ => {}
        }
    }
    o
}

/// The body split at `cuts` (sorted, within the body), streamed.
fn streamed(data: &[u8], cuts: &[usize]) -> Outcome {
    let mut msgs = vec![headers(DUPLEX, data.len())];
    let mut start = 0;
    for &c in cuts.iter().chain(std::iter::once(&data.len())) {
        msgs.push(body(&data[start..c], c == data.len()));
        start = c;
    }
    outcome(&kvepp::extproc::drive(shared(), msgs))
}

pub fn request_body(data: &[u8]) {
    let Some((&ctl, data)) = data.split_first() else {
        return;
    };
    // Up to 7 cut points from a small generator seeded by the control byte (empty chunks included).
    let mut x = u32::from(ctl) | 0x100;
    let mut cuts: Vec<usize> = (0..ctl % 8)
        .map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (x as usize >> 8) % (data.len() + 1)
        })
        .collect();
    cuts.sort_unstable();
    let whole = streamed(data, &[]);
    let split = streamed(data, &cuts);
    assert_eq!(whole, split, "the split {cuts:?} changed the outcome");
    // A routed body goes back unchanged unless the model was rewritten.
    if whole.status.is_none() && !data.windows(2).any(|w| w == b"rw") {
        assert_eq!(whole.body, data, "the body was altered");
    }
    let buffered = outcome(&kvepp::extproc::drive(
        shared(),
        [headers(BUFFERED, data.len()), body(data, true)],
    ));
    assert_eq!(
        (whole.status, &whole.destination),
        (buffered.status, &buffered.destination),
        "BUFFERED and streamed decide differently"
    );
}

// ---------------------------------------------------------------------------------- kv_events

pub fn kv_events(data: &[u8]) {
    let Ok(batch) = kvepp::kv_events::decode::decode_batch(data) else {
        return;
    };
    let mut index = kvepp_core::index::PrefixIndex::new(1024);
    let applied = kvepp::kv_events::apply::apply_batch(&mut index, 1, 0, 16, &batch);
    let stored: usize = batch
        .events
        .iter()
        .map(|e| match e {
            kvepp::kv_events::decode::KvEvent::Stored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum();
    assert!(
        applied.stored as usize <= stored,
        "more blocks stored than the batch carried"
    );
}

// ---------------------------------------------------------------------------------- manifests

pub fn manifests(data: &[u8]) {
    let Ok(objects) = parse_documents(data) else {
        return;
    };
    let store = Datastore::new(pool_ref(), |_| {});
    store.apply(&Inventory { objects });
    let snap = store.snapshot();
    let mut seen: Vec<SocketAddr> = snap.endpoints.iter().map(|e| e.addr).collect();
    let n = seen.len();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), n, "an endpoint listed twice");
}

// ---------------------------------------------------------------------------------- http_json

struct Services {
    rt: tokio::runtime::Runtime,
    select: axum::Router,
    slots: axum::Router,
}

fn services() -> &'static Services {
    static SERVICES: OnceLock<Services> = OnceLock::new();
    SERVICES.get_or_init(|| {
        let catalog = || {
            Arc::new(RwLock::new(Catalog::new(
                KvSettings::default(),
                Limits::default(),
            )))
        };
        let peers = || {
            Arc::new(kvepp::replica::peers::SharedPeers::new(
                kvepp::replica::peers::Peers::new(Vec::new(), None)
                    .unwrap_or_else(|e| panic!("empty peer list refused: {e}")),
            ))
        };
        let access = kvepp::api::auth::Access::default();
        let select = kvepp::api::select::router(
            Arc::new(kvepp::api::select::SelectState::new(catalog(), peers())),
            &access,
        );
        let slots = kvepp::api::slot_tracker::router(
            Arc::new(kvepp::api::slot_tracker::SlotTrackerState {
                catalog: catalog(),
                peers: peers(),
            }),
            &access,
        );
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        Services { rt, select, slots }
    })
}

const SELECT_ROUTES: &[(&str, &str)] = &[
    ("POST", "/workers"),
    ("GET", "/workers"),
    ("PATCH", "/workers/1"),
    ("DELETE", "/workers/1"),
    ("POST", "/select"),
    ("POST", "/select_and_reserve"),
    ("POST", "/reservations"),
    ("DELETE", "/reservations/r1"),
    ("POST", "/reservations/r1/prefill_complete"),
    ("POST", "/reservations/r1/output_block"),
    ("GET", "/loads"),
    ("POST", "/potential_loads"),
    ("POST", "/overlap_scores"),
    ("GET", "/dump"),
    ("POST", "/replica_sync/register_peer"),
    ("POST", "/replica_sync/deregister_peer"),
];

const SLOT_ROUTES: &[(&str, &str)] = &[
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
];

pub fn http_json(data: &[u8]) {
    use tower::ServiceExt;
    let Some((&ctl, body)) = data.split_first() else {
        return;
    };
    let s = services();
    let n = usize::from(ctl) % (SELECT_ROUTES.len() + SLOT_ROUTES.len());
    let (router, (method, path)) = match n.checked_sub(SELECT_ROUTES.len()) {
        None => (&s.select, SELECT_ROUTES[n]),
        Some(i) => (&s.slots, SLOT_ROUTES[i]),
    };
    let Ok(req) = axum::http::Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body.to_vec()))
    else {
        return;
    };
    let (status, bytes) = s.rt.block_on(async {
        let Ok(resp) = router.clone().oneshot(req).await;
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), 4 << 20)
            .await
            .unwrap_or_default();
        (status, bytes)
    });
    assert!(
        [200, 201, 400, 404, 409, 413, 415, 422, 429].contains(&status),
        "{method} {path}: undocumented status {status}"
    );
    if status >= 400 {
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("{method} {path} {status}: error body is not JSON: {e}"));
        assert!(v["error"].is_string(), "{method} {path} {status}: {v}");
    }
}

// ------------------------------------------------------------------------------- replica_sync

struct Replica {
    sink: kvepp::replica::sink::CatalogSink,
    stats: Arc<kvepp::replica::SyncStats>,
}

fn replica() -> &'static Replica {
    static REPLICA: OnceLock<Replica> = OnceLock::new();
    REPLICA.get_or_init(|| {
        let mut catalog = Catalog::new(KvSettings::default(), Limits::default());
        let scope = Scope {
            model: "m".into(),
            tenant: "default".into(),
        };
        let _ = catalog.register(
            scope,
            Worker {
                worker_id: 1,
                block_size: 16,
                dp_start: 0,
                dp_size: 2,
                endpoint: None,
                kv_events_endpoints: Default::default(),
                replay_endpoint: None,
            },
        );
        Replica {
            sink: kvepp::replica::sink::CatalogSink {
                catalog: Arc::new(RwLock::new(catalog)),
                ids: kvepp::replica::sink::Ids::Global,
            },
            stats: Arc::default(),
        }
    })
}

const OUTCOMES: [&str; 6] = [
    "applied",
    "dropped_own",
    "dropped_version",
    "dropped_undecodable",
    "dropped_unknown",
    "dropped_duplicate",
];

pub fn replica_sync(data: &[u8]) {
    let r = replica();
    let count = |o: &'static str| r.stats.get(o);
    let before: u64 = OUTCOMES.iter().map(|o| count(o)).sum();
    let received = count("received");
    kvepp::replica::receive(data, 7, &r.sink, &r.stats);
    let after: u64 = OUTCOMES.iter().map(|o| count(o)).sum();
    assert_eq!(count("received"), received + 1);
    assert_eq!(after, before + 1, "one outcome per message");
}
