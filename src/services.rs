//! Wiring of the standalone HTTP services, `kvepp select-service` and `kvepp slot-tracker`, with
//! exactly the flags of Dynamo's `dynamo.select_service` and `dynamo.slot_tracker`: a catalog of
//! registered workers ([`kvepp_core::catalog`]), its routes ([`crate::api::select`],
//! [`crate::api::slot_tracker`]), KV-event subscriptions for registered workers (selection
//! service), and a timer that expires stale requests. Scheduling knobs come from the
//! `DYN_ROUTER_*` environment variables, as Dynamo's do.
//!
//! Replica sync (`--replica-sync-*`): a PUB socket on the bound port and a SUB per peer of the peer
//! list (the flags' peers, then the peer routes' changes) share admissions, prefill completions and
//! frees ([`crate::replica`]). Index recovery (`--indexer-peers`): the peers' `/dump` are asked in
//! turn before the service answers, and the first good one is applied
//! ([`crate::replica::recovery`]).

use parking_lot::RwLock;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::api::auth::{Access, ApiToken};
use crate::api::select::SelectState;
use crate::api::slot_tracker::SlotTrackerState;
use crate::metrics::Metrics;
use crate::replica::observer::PublishBookings;
use crate::replica::peers::{parse_list, validate_endpoint, Peers, SharedPeers};
use crate::replica::sink::{CatalogSink, Ids};
use crate::replica::Replica;
use kvepp_core::catalog::{Catalog, Limits, Scope};
use kvepp_core::cost::CostWeights;
use kvepp_core::KvSettings;

/// How often stale requests (older than 300 s) are expired.
const EXPIRE_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{0}")]
    Token(#[from] crate::api::auth::TokenError),
    #[error("HTTP server failed: {0}")]
    Serve(std::io::Error),
}

/// `kvepp select-service` (seed: the standalone selection service).
#[derive(Debug, Clone, clap::Args)]
pub struct SelectArgs {
    /// HTTP server port.
    #[arg(long, default_value_t = 8092)]
    pub port: u16,
    /// KV indexer worker threads (the service's runtime threads).
    #[arg(long, default_value_t = 4)]
    pub threads: usize,
    /// Comma-separated HTTP URLs used for startup KV recovery through /dump.
    #[arg(long)]
    pub indexer_peers: Option<String>,
    /// Local ZMQ PUB port for active-load lifecycle events (binds tcp://*:<port>).
    #[arg(long)]
    pub replica_sync_port: Option<u16>,
    /// Comma-separated ZMQ PUB endpoints of selector peers. Requires --replica-sync-port.
    #[arg(long, requires = "replica_sync_port")]
    pub replica_sync_peers: Option<String>,
    /// Address the HTTP server binds: loopback unless told otherwise (e.g. 0.0.0.0).
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub host: IpAddr,
    /// File holding the bearer token every route but GET ones requires (unset: none).
    #[arg(long, env = "KVEPP_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
}

/// `kvepp slot-tracker` (seed: the standalone slot tracker).
#[derive(Debug, Clone, clap::Args)]
pub struct SlotTrackerArgs {
    /// HTTP server port.
    #[arg(long, default_value_t = 8091)]
    pub port: u16,
    /// ZMQ PUB endpoint to bind for replica sync, e.g. tcp://*:8092.
    #[arg(long)]
    pub replica_sync_bind: Option<String>,
    /// The externally reachable form of the bound endpoint (never registered as a peer).
    #[arg(long)]
    pub replica_sync_advertise: Option<String>,
    /// Comma-separated peer PUB endpoints.
    #[arg(long)]
    pub replica_sync_peers: Option<String>,
    /// Address the HTTP server binds: loopback unless told otherwise (e.g. 0.0.0.0).
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    pub host: IpAddr,
    /// File holding the bearer token every route but GET ones requires (unset: none).
    #[arg(long, env = "KVEPP_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
}

/// The catalog's settings: Dynamo's knobs from the environment.
fn kv_settings() -> Result<KvSettings, ServiceError> {
    let weights =
        crate::config::router_knobs_from_env(CostWeights::default(), |k| std::env::var(k).ok())
            .map_err(|errs| {
                ServiceError::Invalid(
                    errs.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; "),
                )
            })?;
    Ok(KvSettings {
        weights,
        table_seed: fastrand::u64(..),
        // Dynamo's own indexer reads every block up to the first gap; the standalone services are
        // its drop-in, so they keep that exact walk whatever the workers' eviction order.
        prefix_closed: false,
        ..KvSettings::default()
    })
}

pub async fn bind(host: IpAddr, port: u16) -> Result<TcpListener, ServiceError> {
    let addr = SocketAddr::new(host, port);
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServiceError::Bind { addr, source })
}

/// The token guard of a standalone service (refusals are logged; these services have no
/// metrics port).
fn access(token_file: Option<&std::path::Path>) -> Result<Access, ServiceError> {
    Ok(Access {
        token: ApiToken::load(token_file)?,
        refused: Default::default(),
    })
}

/// Expires stale requests until `stop`.
async fn expire_loop(catalog: Arc<RwLock<Catalog>>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let n = catalog
                    .read()

                    .expire(Instant::now());
                if n > 0 {
                    tracing::warn!(expired = n, "stale requests expired");
                }
            }
            _ = stop.changed() => if *stop.borrow() { return },
        }
    }
}

async fn serve_router(
    listener: TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(ServiceError::Serve)
}

/// Replica sync for a service's catalog: PUB on `bind` (when set), SUB to the peer list as it
/// changes, peers' events applied to the catalog, and every scope's bookings published (a
/// listener on each scope's state, under that scope).
pub async fn start_replica(
    bind: Option<&str>,
    peers: &SharedPeers,
    catalog: &Arc<RwLock<Catalog>>,
    ids: Ids,
    stop: &watch::Receiver<bool>,
) -> Result<Replica, ServiceError> {
    let sink = Arc::new(CatalogSink {
        catalog: catalog.clone(),
        ids,
    });
    let stats = Arc::new(crate::replica::SyncStats::default());
    Metrics::new().add(&*stats);
    let replica = crate::replica::start(bind, peers.subscribe(), sink, stats, stop.clone())
        .await
        .map_err(|e| ServiceError::Invalid(e.to_string()))?;
    if replica.bound.is_some() {
        let outbox = replica.outbox.clone();
        catalog
            .write()
            .set_listeners(Arc::new(move |scope: &Scope| {
                Some(Arc::new(PublishBookings {
                    outbox: outbox.clone(),
                    scope: scope.clone(),
                }) as Arc<dyn kvepp_core::Listener>)
            }));
    }
    Ok(replica)
}

/// Validates the selection service's flags; returns the peer list they seed.
pub fn select_peers(args: &SelectArgs) -> Result<Peers, ServiceError> {
    ApiToken::load(args.api_token_file.as_deref())?;
    for url in parse_list(args.indexer_peers.as_deref()) {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(ServiceError::Invalid(format!(
                "--indexer-peers: {url:?} is not an http(s) URL"
            )));
        }
    }
    Peers::new(parse_list(args.replica_sync_peers.as_deref()), None)
        .map_err(|e| ServiceError::Invalid(format!("--replica-sync-peers: {e}")))
}

/// Runs the selection service on `listener` until `shutdown`.
pub async fn run_select(
    args: SelectArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    let peers = Arc::new(SharedPeers::new(select_peers(&args)?));
    let catalog = Arc::new(RwLock::new(Catalog::new(kv_settings()?, Limits::default())));
    let (stop_tx, stop_rx) = watch::channel(false);
    let indexer_peers = parse_list(args.indexer_peers.as_deref());
    if !indexer_peers.is_empty() {
        // Before the first request is answered: /ready cannot turn 200 without it.
        if let Err(e) = crate::replica::recovery::recover(&catalog, &indexer_peers).await {
            tracing::warn!(error = %e, "starting without a recovered KV index");
        }
    }
    let bind = args.replica_sync_port.map(|p| format!("tcp://*:{p}"));
    start_replica(bind.as_deref(), &peers, &catalog, Ids::Global, &stop_rx).await?;
    let state = Arc::new(SelectState::new(catalog.clone(), peers));
    let subs = tokio::spawn(crate::kv_events::apply::run_registered(
        state.subscriptions.subscribe(),
        Metrics::new(),
        stop_rx.clone(),
    ));
    let expire = tokio::spawn(expire_loop(catalog, stop_rx));
    tracing::info!(addr = ?listener.local_addr().ok(), threads = args.threads, "selection service listening");
    let app = crate::api::select::router(state, &access(args.api_token_file.as_deref())?);
    let served = serve_router(listener, app, shutdown).await;
    let _ = stop_tx.send(true);
    let _ = subs.await;
    expire.abort();
    served
}

/// Validates the slot tracker's flags; returns the peer list they seed.
pub fn slot_tracker_peers(args: &SlotTrackerArgs) -> Result<Peers, ServiceError> {
    ApiToken::load(args.api_token_file.as_deref())?;
    for (flag, v) in [
        ("--replica-sync-bind", &args.replica_sync_bind),
        ("--replica-sync-advertise", &args.replica_sync_advertise),
    ] {
        if let Some(e) = v {
            let probe = e.replace("tcp://*:", "tcp://0.0.0.0:");
            validate_endpoint(&probe).map_err(|m| ServiceError::Invalid(format!("{flag}: {m}")))?;
        }
    }
    if args.replica_sync_bind.is_none()
        && (args.replica_sync_advertise.is_some() || args.replica_sync_peers.is_some())
    {
        return Err(ServiceError::Invalid(
            "--replica-sync-advertise and --replica-sync-peers require --replica-sync-bind".into(),
        ));
    }
    Peers::new(
        parse_list(args.replica_sync_peers.as_deref()),
        args.replica_sync_advertise.clone(),
    )
    .map_err(|e| ServiceError::Invalid(format!("--replica-sync-peers: {e}")))
}

/// Runs the slot tracker on `listener` until `shutdown`.
pub async fn run_slot_tracker(
    args: SlotTrackerArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    let peers = Arc::new(SharedPeers::new(slot_tracker_peers(&args)?));
    let catalog = Arc::new(RwLock::new(Catalog::new(kv_settings()?, Limits::default())));
    let (stop_tx, stop_rx) = watch::channel(false);
    let bind = args.replica_sync_bind.as_deref();
    start_replica(bind, &peers, &catalog, Ids::Scoped, &stop_rx).await?;
    let state = Arc::new(SlotTrackerState {
        catalog: catalog.clone(),
        peers,
    });
    let expire = tokio::spawn(expire_loop(catalog, stop_rx));
    tracing::info!(addr = ?listener.local_addr().ok(), "slot tracker listening");
    let app = crate::api::slot_tracker::router(state, &access(args.api_token_file.as_deref())?);
    let served = serve_router(listener, app, shutdown).await;
    let _ = stop_tx.send(true);
    expire.abort();
    served
}
