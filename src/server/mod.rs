//! Wiring of `kvepp serve`: discovery → datastore → routing core (`kvepp_core::Router`) behind the
//! routing service → ext_proc server, the background tasks fed by the datastore's watch, plus the
//! gRPC health and HTTP metrics servers, with graceful shutdown. Every value comes from
//! [`Config`]; nothing is hard-coded here.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::StreamExt;

mod components;
pub(crate) mod doors;
pub mod reload;
pub(crate) mod tls;

pub use reload::Reloading;

use crate::api::{self, ApiState};
use crate::config::Config;
use crate::discovery::{feed_instances, Datastore, PoolRef};
use crate::engine::metadata::MetadataStore;
use crate::extproc::{ExtProcServer, ExtProcService};
use crate::metrics::Metrics;
use kvepp_tokenizer::ModelTokenizer;

/// Bounds of the ext_proc port's HTTP/2 stream window, which is sized to `max_body_bytes` so a
/// body streams without waiting for window updates: at least 1 MiB (HTTP/2's default 64 KiB
/// stalls a large body every few frames), at most 16 MiB (the memory one stream may hold in
/// flight); the connection window is four streams' worth.
const GRPC_WINDOW: (u32, u32) = (1 << 20, 16 << 20);

pub(crate) const EXT_PROC_SERVICE: &str = crate::extproc::SERVICE;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot bind {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("{what} server failed: {message}")]
    Serve { what: &'static str, message: String },
    #[error(transparent)]
    Topology(#[from] crate::discovery::cluster_topology::TopologyCheckError),
    #[error("discovery: {0}")]
    Discovery(#[from] crate::discovery::service::DiscoveryError),
    #[error("replica sync: {0}")]
    Replica(#[from] crate::replica::ReplicaError),
    #[error("ext_proc TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("API token: {0}")]
    Token(#[from] crate::api::auth::TokenError),
    #[error("tokenizer of model {model}: {source}")]
    Tokenizer {
        model: String,
        source: kvepp_tokenizer::TokenizeError,
    },
}

/// The three listening sockets; bound before serving so callers (and tests) can use port 0.
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub health: TcpListener,
    pub metrics: TcpListener,
    /// The Dynamo-compatible HTTP doors, when configured.
    pub doors: doors::Doors,
}

impl Listeners {
    pub async fn bind(cfg: &Config) -> Result<Self, ServerError> {
        let ip = cfg.bind_address;
        let admin = cfg.admin_bind_address;
        async fn one(what: &'static str, addr: SocketAddr) -> Result<TcpListener, ServerError> {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { what, addr, source })
        }
        Ok(Listeners {
            grpc: one("ext_proc gRPC", (ip, cfg.grpc_port).into()).await?,
            health: one("gRPC health", (admin, cfg.grpc_health_port).into()).await?,
            metrics: one("metrics", (admin, cfg.metrics_port).into()).await?,
            doors: doors::Doors {
                select: match cfg.select_service_port {
                    Some(p) => Some(one("selection service", (admin, p).into()).await?),
                    None => None,
                },
                slots: match cfg.slot_tracker_port {
                    Some(p) => Some(one("slot tracker", (admin, p).into()).await?),
                    None => None,
                },
            },
        })
    }

    pub fn addrs(&self) -> [Option<SocketAddr>; 3] {
        [
            self.grpc.local_addr().ok(),
            self.health.local_addr().ok(),
            self.metrics.local_addr().ok(),
        ]
    }
}

fn incoming(
    l: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    TcpListenerStream::new(l).map(|s| {
        let s = s?;
        s.set_nodelay(true)?;
        Ok(s)
    })
}

/// The design's admission checks of `kv_transfer_topology_level` against the configured Grove
/// ClusterTopology (manifests directory, else the Kubernetes API); nothing without both.
async fn check_cluster_topology(cfg: &Config) -> Result<(), ServerError> {
    use crate::discovery::cluster_topology::{self as ct, TopologyCheckError};
    let (Some(name), Some(level)) = (
        &cfg.cluster_topology,
        &cfg.disaggregation.kv_transfer_topology_level,
    ) else {
        return Ok(());
    };
    let read = |message: String| TopologyCheckError::Read {
        name: name.clone(),
        message,
    };
    let found = match &cfg.manifests_dir {
        Some(dir) => ct::from_manifests(dir).map_err(|e| read(e.to_string()))?,
        None => {
            let client = crate::discovery::kubernetes::client(cfg.kubeconfig.as_deref()).await?;
            ct::from_cluster(client)
                .await
                .map_err(|e| read(e.to_string()))?
        }
    };
    let levels = ct::check(&found, name, level)?;
    tracing::info!(cluster_topology = %name, level = %level, levels = ?levels,
        "kv_transfer_topology_level is a level of the ClusterTopology");
    Ok(())
}

/// Runs until `shutdown` completes, then stops accepting and lets open streams finish (bounded by
/// `shutdown_grace_seconds`). The components start in order, each from its own section of `cfg`
/// ([`components::Wiring`]).
pub async fn run(
    cfg: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    run_with(cfg, listeners, shutdown, Hooks::default()).await
}

/// What the binary adds to a server: reloading its configuration, and the trace exporter's
/// counters (traces are on when present).
#[derive(Debug, Default)]
pub struct Hooks {
    pub reloading: Option<Reloading>,
    pub traces: Option<crate::telemetry::TraceMetrics>,
}

/// [`run`], reloading the configuration as `hooks.reloading` says ([`reload`]) and tracing
/// decisions when `hooks.traces` is set.
pub async fn run_with(
    cfg: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    hooks: Hooks,
) -> Result<(), ServerError> {
    let metrics = Metrics::new();
    if let Some(t) = &hooks.traces {
        metrics.add(t);
    }
    let effective = Arc::new(crate::config::live::Effective::new(cfg.clone()));
    // Read before anything starts: a bad certificate or token file stops the start.
    let acceptor = tls::Acceptor::new(&cfg.grpc_tls, metrics.grpc_connections_refused.clone())?;
    let access = crate::api::auth::Access {
        token: crate::api::auth::ApiToken::load(cfg.api_token_file.as_deref())?,
        refused: metrics.http_unauthorized.clone(),
    };
    let counters = crate::discovery::DiscoveryCounters::default();
    let gauge = counters.ready_endpoints.clone();
    let conflicts = counters.rewrite_conflicts.clone();
    let store = Arc::new(Datastore::new(pool_ref(&cfg), move |snap| {
        gauge.set(snap.endpoints.len() as i64);
        conflicts.set(snap.rewrites.conflicts as i64);
    }));
    // Before anything is spawned: a refused start leaves nothing running.
    check_cluster_topology(&cfg).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut w = components::Wiring::new(
        cfg,
        metrics.clone(),
        store.clone(),
        stop_rx.clone(),
        counters,
    );
    let discovery = w.discovery().await?;
    w.tasks.push(tokio::spawn(feed_instances(
        store.clone(),
        discovery.clone(),
        stop_rx.clone(),
    )));
    let health_service = w.health().await;
    let md = Arc::new(MetadataStore::default());
    let kv = w.kv_state(&md);
    w.engine_metadata(&kv, &md);
    if w.cfg.engine_metrics.enabled {
        w.engine_scraper(&kv);
    }
    let router = w.router(&kv);
    w.recover_index(&kv, &router).await;
    w.upkeep(&router);
    let request_router = w.routing(&router)?;
    let routing: Arc<dyn crate::routing::RouteRequest> = request_router.clone();
    let flow = w.flow_control(&router, &routing);
    let cfg = w.cfg.clone();
    let shared = w.ext_proc_door(&router, routing, &flow, hooks.traces.is_some());
    let shared_limits = shared.limits.clone();
    let extproc = ExtProcService::new(shared.clone()).into_server();
    if let Some(how) = hooks.reloading {
        let counters = reload::ReloadMetrics::default();
        metrics.add(&counters);
        let live = Arc::new(reload::Live {
            effective: effective.clone(),
            router: router.clone(),
            routing: request_router,
            shared,
            flow,
            scrape: w.scrape.clone(),
            acceptor: acceptor.clone(),
            metrics: metrics.clone(),
            counters,
        });
        w.tasks
            .push(tokio::spawn(reload::run(live, how, stop_rx.clone())));
    }

    let [g, h, m] = listeners.addrs();
    tracing::info!(ext_proc = ?g, health = ?h, metrics = ?m, "kvepp serving");
    // Replica sync's counters, registered by replica sync itself.
    let sync_stats = Arc::new(crate::replica::SyncStats::default());
    metrics.add(&*sync_stats);
    let doors = match &kv {
        Some(_) => {
            crate::server::doors::start(
                &cfg,
                &router,
                &store,
                discovery,
                listeners.doors,
                &access,
                &shared_limits,
                sync_stats,
                &stop_rx,
                &mut w.tasks,
            )
            .await?
        }
        None => Vec::new(),
    };
    let tasks = std::mem::take(&mut w.tasks);
    let draining = w.draining.clone();
    let servers = Servers {
        grpc: listeners.grpc,
        health: listeners.health,
        metrics: listeners.metrics,
    };
    let served = serve(
        &cfg,
        servers,
        (extproc, health_service, acceptor),
        ApiState {
            metrics,
            store,
            kv,
            router: Some(router.clone()),
            config: Some(config_view(effective)),
            draining: Some(draining.subscribe()),
        },
        &access,
        doors,
        &stop_rx,
    );
    shutdown.await;
    drain(&cfg, (draining, stop_tx), served, tasks).await
}

/// The InferencePool this process serves, as the tree names it.
fn pool_ref(cfg: &Config) -> PoolRef {
    PoolRef {
        name: cfg.pool_name.clone(),
        namespace: cfg.pool_namespace.clone(),
        service: cfg.endpoint_service().to_owned(),
        picker_service: cfg.endpoint_picker_service.clone(),
    }
}

/// `/debug/config`'s view of the configuration in effect.
fn config_view(effective: Arc<crate::config::live::Effective>) -> api::ConfigView {
    api::ConfigView(Arc::new(move || {
        let (version, cfg) = effective.get();
        serde_json::json!({ "version": version, "config": &*cfg })
    }))
}

/// The listeners of the servers `kvepp serve` always runs.
struct Servers {
    grpc: TcpListener,
    health: TcpListener,
    metrics: TcpListener,
}

/// The running servers: ext_proc, gRPC health, and HTTP (metrics, debug, and the HTTP doors).
struct Running {
    grpc: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    health: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    http: tokio::task::JoinHandle<std::io::Result<()>>,
}

type Doors = Vec<tokio::task::JoinHandle<std::io::Result<()>>>;

/// Starts the servers; each stops accepting when `stop` turns true.
fn serve<H: tonic_health::pb::health_server::Health>(
    cfg: &Config,
    servers: Servers,
    (extproc, health_service, acceptor): (
        ExtProcServer,
        tonic_health::pb::health_server::HealthServer<H>,
        tls::Acceptor,
    ),
    api_state: ApiState,
    access: &crate::api::auth::Access,
    doors: Doors,
    stop: &watch::Receiver<bool>,
) -> Running {
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let window = (cfg.max_body_bytes as u32).clamp(GRPC_WINDOW.0, GRPC_WINDOW.1);
    tracing::info!(tls = ?cfg.grpc_tls.mode, plaintext = cfg.grpc_tls.accept_plaintext,
        mutual = cfg.grpc_tls.client_ca_file.is_some(), "ext_proc transport");
    // The ext_proc port answers gRPC health checks too: the proxy's cluster checks the port it
    // sends streams to.
    let grpc = tonic::transport::Server::builder()
        .initial_stream_window_size(window)
        .initial_connection_window_size(window.saturating_mul(4))
        .add_service(extproc)
        .add_service(health_service.clone())
        .serve_with_incoming_shutdown(acceptor.incoming(servers.grpc), stopped(stop.clone()));
    let health = tonic::transport::Server::builder()
        .add_service(health_service)
        .serve_with_incoming_shutdown(incoming(servers.health), stopped(stop.clone()));
    let http = axum::serve(servers.metrics, api::router(api_state, access))
        .with_graceful_shutdown(stopped(stop.clone()));
    Running {
        grpc: tokio::spawn(grpc),
        health: tokio::spawn(health),
        http: tokio::spawn(async move {
            let (main, doors) = tokio::join!(http, futures::future::join_all(doors));
            let doors = doors.into_iter().try_for_each(|d| match d {
                Ok(r) => r,
                Err(e) => Err(std::io::Error::other(e)),
            });
            main.and(doors)
        }),
    }
}

/// Stops: not ready at once while still serving for `shutdown_delay_ms` (the proxy's health
/// checks move new streams to other replicas), then no new connections (HTTP/2 GOAWAY on open
/// ones), open streams finish within the grace period; then the background tasks are aborted.
async fn drain(
    cfg: &Config,
    (draining, stop_tx): (watch::Sender<bool>, watch::Sender<bool>),
    running: Running,
    tasks: Vec<tokio::task::JoinHandle<()>>,
) -> Result<(), ServerError> {
    let delay = Duration::from_millis(cfg.shutdown_delay_ms);
    tracing::info!(
        delay_ms = cfg.shutdown_delay_ms,
        grace_seconds = cfg.shutdown_grace_seconds,
        "shutting down: not ready now; listeners close after the delay, then open streams finish"
    );
    let _ = draining.send(true);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    tracing::info!("closing the listeners (GOAWAY to open connections)");
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs(cfg.shutdown_grace_seconds);
    let drained = tokio::time::timeout(grace, async {
        tokio::join!(running.grpc, running.health, running.http)
    })
    .await;
    for t in tasks {
        t.abort();
    }
    match drained {
        Err(_) => {
            tracing::warn!("grace period over; closing remaining streams");
            Ok(())
        }
        Ok((a, b, c)) => {
            flatten("ext_proc", a.map(|r| r.map_err(|e| e.to_string())))?;
            flatten("health", b.map(|r| r.map_err(|e| e.to_string())))?;
            flatten("metrics", c.map(|r| r.map_err(|e| e.to_string())))?;
            tracing::info!("shutdown complete");
            Ok(())
        }
    }
}

/// The counts of a model's tokenizer and its caches, as the metrics read them at each scrape.
fn tokenizer_source(
    model: &str,
    tokenizer: &Arc<ModelTokenizer>,
) -> Box<dyn Fn() -> Option<crate::metrics::TokenizerSample> + Send + Sync> {
    let (model, tokenizer): (Arc<str>, _) = (model.into(), Arc::downgrade(tokenizer));
    Box::new(move || {
        let t = tokenizer.upgrade()?;
        let (m, work) = (t.message_stats(), t.tokenizer_stats());
        let mut caches = vec![("messages", m.hits, m.misses)];
        caches.extend(t.segment_stats().map(|s| ("segments", s.hits, s.misses)));
        caches.extend(t.render_stats().map(|s| ("renders", s.hits, s.misses)));
        Some(crate::metrics::TokenizerSample {
            model: model.clone(),
            caches,
            calls: work.calls,
            cpu_nanos: work.cpu_nanos,
        })
    })
}

fn flatten(
    what: &'static str,
    r: Result<Result<(), String>, tokio::task::JoinError>,
) -> Result<(), ServerError> {
    match r {
        Ok(Ok(())) => Ok(()),
        Ok(Err(message)) => Err(ServerError::Serve { what, message }),
        Err(e) => Err(ServerError::Serve {
            what,
            message: e.to_string(),
        }),
    }
}

/// kvepp serving `cfg` on a task of the current runtime (the test harness and `kvepp
/// bench-routing` run it this way); stops when [`InProcess::stop`] is called or it is dropped.
#[derive(Debug)]
pub struct InProcess {
    pub grpc: SocketAddr,
    pub health: SocketAddr,
    pub metrics: SocketAddr,
    pub select_service: Option<SocketAddr>,
    pub slot_tracker: Option<SocketAddr>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ServerError>>,
}

impl InProcess {
    /// Binds the listeners (port 0: ephemeral) and starts serving; `cfg` must be valid.
    pub async fn start(cfg: Config) -> Result<Self, ServerError> {
        let listeners = Listeners::bind(&cfg).await?;
        let [Some(grpc), Some(health), Some(metrics)] = listeners.addrs() else {
            return Err(ServerError::Serve {
                what: "listeners",
                message: "a bound listener has no local address".into(),
            });
        };
        let select_service = listeners
            .doors
            .select
            .as_ref()
            .and_then(|l| l.local_addr().ok());
        let slot_tracker = listeners
            .doors
            .slots
            .as_ref()
            .and_then(|l| l.local_addr().ok());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(run(cfg, listeners, async {
            let _ = stopped.await;
        }));
        Ok(InProcess {
            grpc,
            health,
            metrics,
            select_service,
            slot_tracker,
            stop,
            task,
        })
    }

    /// Shuts down (grace period as configured) and returns how serving ended.
    pub async fn stop(self) -> Result<(), ServerError> {
        let _ = self.stop.send(());
        self.task.await.map_err(|e| ServerError::Serve {
            what: "kvepp",
            message: e.to_string(),
        })?
    }
}
