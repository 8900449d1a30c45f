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
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::api::auth::{Access, ApiToken};
use crate::api::select::SelectState;
use crate::api::slot_tracker::SlotTrackerState;
use crate::config::Config;
use crate::replica::observer::PublishBookings;
use crate::replica::peers::{parse_list, SharedPeers};
use crate::replica::sink::{CatalogSink, Ids};
use crate::replica::Replica;
use kvepp_core::catalog::{Catalog, Limits, Scope};
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

/// `kvepp select-service`, the standalone selection service: Dynamo's flags, each with a
/// `KVEPP_SELECT_SERVICE_*` variable, over the `select_service` section of `--config FILE` (the
/// defaults are the section's, shown here as Dynamo's documentation shows them).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SelectArgs {
    /// Configuration file (YAML or JSON): its `select_service`, `router` and `api_token_file`.
    #[arg(long, env = "KVEPP_CONFIG")]
    pub config: Option<PathBuf>,
    /// HTTP server port. [default: 8092]
    #[arg(long, env = "KVEPP_SELECT_SERVICE_PORT")]
    pub port: Option<u16>,
    /// KV indexer worker threads (the service's runtime threads). [default: 4]
    #[arg(long, env = "KVEPP_SELECT_SERVICE_THREADS")]
    pub threads: Option<usize>,
    /// Comma-separated HTTP URLs used for startup KV recovery through /dump.
    #[arg(long, env = "KVEPP_SELECT_SERVICE_INDEXER_PEERS")]
    pub indexer_peers: Option<String>,
    /// Local ZMQ PUB port for active-load lifecycle events (binds `tcp://*:<port>`).
    #[arg(long, env = "KVEPP_SELECT_SERVICE_REPLICA_SYNC_PORT")]
    pub replica_sync_port: Option<u16>,
    /// Comma-separated ZMQ PUB endpoints of selector peers. Requires --replica-sync-port.
    #[arg(long, env = "KVEPP_SELECT_SERVICE_REPLICA_SYNC_PEERS")]
    pub replica_sync_peers: Option<String>,
    /// Address the HTTP server binds: loopback unless told otherwise (e.g. 0.0.0.0).
    /// [default: 127.0.0.1]
    #[arg(long, env = "KVEPP_SELECT_SERVICE_HOST")]
    pub host: Option<IpAddr>,
    /// File holding the bearer token every route but GET ones requires (unset: none).
    #[arg(long, env = "KVEPP_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
}

/// `kvepp slot-tracker`, the standalone slot tracker: Dynamo's flags, each with a
/// `KVEPP_SLOT_TRACKER_*` variable, over the `slot_tracker` section of `--config FILE`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SlotTrackerArgs {
    /// Configuration file (YAML or JSON): its `slot_tracker`, `router` and `api_token_file`.
    #[arg(long, env = "KVEPP_CONFIG")]
    pub config: Option<PathBuf>,
    /// HTTP server port. [default: 8091]
    #[arg(long, env = "KVEPP_SLOT_TRACKER_PORT")]
    pub port: Option<u16>,
    /// ZMQ PUB endpoint to bind for replica sync, e.g. tcp://*:8092.
    #[arg(long, env = "KVEPP_SLOT_TRACKER_REPLICA_SYNC_BIND")]
    pub replica_sync_bind: Option<String>,
    /// The externally reachable form of the bound endpoint (never registered as a peer).
    #[arg(long, env = "KVEPP_SLOT_TRACKER_REPLICA_SYNC_ADVERTISE")]
    pub replica_sync_advertise: Option<String>,
    /// Comma-separated peer PUB endpoints.
    #[arg(long, env = "KVEPP_SLOT_TRACKER_REPLICA_SYNC_PEERS")]
    pub replica_sync_peers: Option<String>,
    /// Address the HTTP server binds: loopback unless told otherwise (e.g. 0.0.0.0).
    /// [default: 127.0.0.1]
    #[arg(long, env = "KVEPP_SLOT_TRACKER_HOST")]
    pub host: Option<IpAddr>,
    /// File holding the bearer token every route but GET ones requires (unset: none).
    #[arg(long, env = "KVEPP_API_TOKEN_FILE")]
    pub api_token_file: Option<PathBuf>,
}

/// The tree as a standalone service reads it: the file (or the defaults), Dynamo's
/// `DYN_ROUTER_*` knobs over its `router`, and the token file flag.
fn service_tree(
    config: Option<&std::path::Path>,
    token: &Option<PathBuf>,
) -> Result<Config, ServiceError> {
    let mut cfg = match config {
        Some(path) => Config::from_file(path).map_err(|e| ServiceError::Invalid(e.to_string()))?,
        None => Config::default(),
    };
    cfg.router = crate::config::router_knobs_from_env(cfg.router, |k| std::env::var(k).ok())
        .map_err(|errs| invalid(errs.iter().map(ToString::to_string)))?;
    if token.is_some() {
        cfg.api_token_file.clone_from(token);
    }
    Ok(cfg)
}

fn invalid(errs: impl Iterator<Item = String>) -> ServiceError {
    ServiceError::Invalid(errs.collect::<Vec<_>>().join("; "))
}

impl SelectArgs {
    /// Defaults → `--config FILE` → environment → flags, validated (one message per bad field).
    pub fn load(&self) -> Result<Config, ServiceError> {
        let mut cfg = service_tree(self.config.as_deref(), &self.api_token_file)?;
        let s = &mut cfg.select_service;
        s.port = self.port.unwrap_or(s.port);
        s.threads = self.threads.unwrap_or(s.threads);
        s.host = self.host.unwrap_or(s.host);
        if let Some(v) = &self.indexer_peers {
            s.indexer_peers = parse_list(Some(v));
        }
        if self.replica_sync_port.is_some() {
            s.replica_sync_port = self.replica_sync_port;
        }
        if let Some(v) = &self.replica_sync_peers {
            s.replica_sync_peers = parse_list(Some(v));
        }
        cfg.validate_select_service()
            .map_err(|errs| invalid(errs.iter().map(ToString::to_string)))?;
        Ok(cfg)
    }
}

impl SlotTrackerArgs {
    /// Defaults → `--config FILE` → environment → flags, validated (one message per bad field).
    pub fn load(&self) -> Result<Config, ServiceError> {
        let mut cfg = service_tree(self.config.as_deref(), &self.api_token_file)?;
        let s = &mut cfg.slot_tracker;
        s.port = self.port.unwrap_or(s.port);
        s.host = self.host.unwrap_or(s.host);
        for (flag, slot) in [
            (&self.replica_sync_bind, &mut s.replica_sync_bind),
            (&self.replica_sync_advertise, &mut s.replica_sync_advertise),
        ] {
            if flag.is_some() {
                slot.clone_from(flag);
            }
        }
        if let Some(v) = &self.replica_sync_peers {
            s.replica_sync_peers = parse_list(Some(v));
        }
        cfg.validate_slot_tracker()
            .map_err(|errs| invalid(errs.iter().map(ToString::to_string)))?;
        Ok(cfg)
    }
}

/// The catalog's settings: the tree's cost knobs (Dynamo's `DYN_ROUTER_*` applied), under
/// Dynamo's cost and without kvepp's bounded loads whatever the EPP's `router` says: the
/// services are Dynamo's drop-in, and their answers are Dynamo's formula.
fn kv_settings(cfg: &Config) -> KvSettings {
    KvSettings {
        weights: kvepp_core::cost::CostWeights {
            cost_model: kvepp_core::cost::CostModel::Dynamo,
            load_bound: 0.0,
            load_bound_cached: 0.0,
            speculative: false,
            ..cfg.router
        },
        table_seed: fastrand::u64(..),
        // Dynamo's own indexer reads every block up to the first gap; the standalone services are
        // its drop-in, so they keep that exact walk whatever the workers' eviction order.
        prefix_closed: false,
        ..KvSettings::default()
    }
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
pub(crate) async fn expire_loop(catalog: Arc<RwLock<Catalog>>, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let n = catalog.read().expire(Instant::now());
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
pub(crate) async fn start_replica(
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
    // No metrics port here: replica sync's counters are kept, not exported.
    let stats = Arc::new(crate::replica::SyncStats::default());
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

/// Runs the selection service with `args` on `listener` until `shutdown`.
pub async fn run_select(
    args: SelectArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    run_select_with(args.load()?, listener, shutdown).await
}

/// Runs the selection service from its section of `cfg` on `listener` until `shutdown`.
pub async fn run_select_with(
    cfg: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    let sc = &cfg.select_service;
    let peers = Arc::new(SharedPeers::new(sc.peers().map_err(ServiceError::Invalid)?));
    let catalog = Arc::new(RwLock::new(
        Catalog::new(kv_settings(&cfg), Limits::default())
            .with_sessions(cfg.session_affinity.clone()),
    ));
    let (stop_tx, stop_rx) = watch::channel(false);
    let indexer_peers = &sc.indexer_peers;
    if !indexer_peers.is_empty() {
        // Before the first request is answered: /ready cannot turn 200 without it.
        if let Err(e) = crate::replica::recovery::recover(&catalog, indexer_peers).await {
            tracing::warn!(error = %e, "starting without a recovered KV index");
        }
    }
    let bind = sc.replica_sync_port.map(|p| format!("tcp://*:{p}"));
    start_replica(bind.as_deref(), &peers, &catalog, Ids::Global, &stop_rx).await?;
    let state = Arc::new(SelectState::new(catalog.clone(), peers));
    let subs = tokio::spawn(crate::kv_events::apply::run_registered(
        state.subscriptions.subscribe(),
        // No metrics port here: counted, not exported.
        Arc::default(),
        stop_rx.clone(),
    ));
    let expire = tokio::spawn(expire_loop(catalog, stop_rx));
    tracing::info!(addr = ?listener.local_addr().ok(), threads = sc.threads, "selection service listening");
    let app = crate::api::select::router(state, &access(cfg.api_token_file.as_deref())?);
    let served = serve_router(listener, app, shutdown).await;
    let _ = stop_tx.send(true);
    let _ = subs.await;
    expire.abort();
    served
}

/// Runs the slot tracker with `args` on `listener` until `shutdown`.
pub async fn run_slot_tracker(
    args: SlotTrackerArgs,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    run_slot_tracker_with(args.load()?, listener, shutdown).await
}

/// Runs the slot tracker from its section of `cfg` on `listener` until `shutdown`.
pub async fn run_slot_tracker_with(
    cfg: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServiceError> {
    let sc = &cfg.slot_tracker;
    let peers = Arc::new(SharedPeers::new(sc.peers().map_err(ServiceError::Invalid)?));
    let catalog = Arc::new(RwLock::new(
        Catalog::new(kv_settings(&cfg), Limits::default())
            .with_sessions(cfg.session_affinity.clone()),
    ));
    let (stop_tx, stop_rx) = watch::channel(false);
    let bind = sc.replica_sync_bind.as_deref();
    start_replica(bind, &peers, &catalog, Ids::Scoped, &stop_rx).await?;
    let state = Arc::new(SlotTrackerState {
        catalog: catalog.clone(),
        peers,
    });
    let expire = tokio::spawn(expire_loop(catalog, stop_rx));
    tracing::info!(addr = ?listener.local_addr().ok(), "slot tracker listening");
    let app = crate::api::slot_tracker::router(state, &access(cfg.api_token_file.as_deref())?);
    let served = serve_router(listener, app, shutdown).await;
    let _ = stop_tx.send(true);
    expire.abort();
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_load_defaults_then_the_file_then_flags() {
        let dir = std::env::temp_dir().join(format!("kvepp-services-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("kvepp.yaml");
        std::fs::write(
            &file,
            "select_service: {port: 7000, threads: 2, indexer_peers: ['http://a:9090']}\nslot_tracker: {port: 7001, replica_sync_bind: 'tcp://*:7002'}\nrouter: {temperature: 0.5}\n",
        )
        .unwrap();
        let defaults = SelectArgs::default().load().unwrap();
        assert_eq!(defaults.select_service.port, 8092);
        assert_eq!(defaults.select_service.threads, 4);
        let args = SelectArgs {
            config: Some(file.clone()),
            threads: Some(3),
            ..SelectArgs::default()
        };
        let cfg = args.load().unwrap();
        assert_eq!(cfg.select_service.port, 7000, "from the file");
        assert_eq!(cfg.select_service.threads, 3, "the flag wins");
        assert_eq!(cfg.select_service.indexer_peers, ["http://a:9090"]);
        assert_eq!(cfg.router.temperature, 0.5, "the tree's router section");
        let slots = SlotTrackerArgs {
            config: Some(file.clone()),
            replica_sync_peers: Some("tcp://b:1, tcp://c:2".into()),
            ..SlotTrackerArgs::default()
        }
        .load()
        .unwrap();
        assert_eq!(slots.slot_tracker.port, 7001);
        assert_eq!(
            slots.slot_tracker.replica_sync_peers,
            ["tcp://b:1", "tcp://c:2"]
        );
        // A bad value from the file is refused naming its flag, like one from the flags.
        std::fs::write(&file, "select_service: {threads: 0}\n").unwrap();
        let err = SelectArgs {
            config: Some(file.clone()),
            ..SelectArgs::default()
        }
        .load()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--threads 0"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
