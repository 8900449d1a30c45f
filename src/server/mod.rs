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
use tonic_health::ServingStatus;

mod shared;
pub mod tls;

use crate::api::{self, ApiState};
use crate::config::{Config, PickerKind, UnknownModels};
use crate::discovery::kubernetes::{KubeCatalog, KubeDiscovery};
use crate::discovery::{
    feed_instances, Datastore, EndpointFacts, ManifestDir, PoolRef, ServiceDiscovery,
};
use crate::engine::metadata::MetadataStore;
use crate::extproc::{ExtProcService, Settings, Shared};
use crate::metrics::Metrics;
use crate::request::tokenize::ModelTokenizer;
use crate::request::{FlowControl, RequestRouter};
use kvepp_core::{KvSettings, KvState, LeastLoaded, RoundRobin, Router, Saturation};

/// Bounds of the ext_proc port's HTTP/2 stream window, which is sized to `max_body_bytes` so a
/// body streams without waiting for window updates: at least 1 MiB (HTTP/2's default 64 KiB
/// stalls a large body every few frames), at most 16 MiB (the memory one stream may hold in
/// flight); the connection window is four streams' worth.
const GRPC_WINDOW: (u32, u32) = (1 << 20, 16 << 20);

pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

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
        source: crate::request::tokenize::TokenizeError,
    },
}

/// The three listening sockets; bound before serving so callers (and tests) can use port 0.
#[derive(Debug)]
pub struct Listeners {
    pub grpc: TcpListener,
    pub health: TcpListener,
    pub metrics: TcpListener,
    /// The selection service's HTTP door, when configured.
    pub select_service: Option<TcpListener>,
    /// The slot tracker's HTTP door, when configured.
    pub slot_tracker: Option<TcpListener>,
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
            select_service: match cfg.select_service_port {
                Some(p) => Some(one("selection service", (admin, p).into()).await?),
                None => None,
            },
            slot_tracker: match cfg.slot_tracker_port {
                Some(p) => Some(one("slot tracker", (admin, p).into()).await?),
                None => None,
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
/// `shutdown_grace_seconds`).
pub async fn run(
    cfg: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServerError> {
    let metrics = Metrics::new();
    // Read before anything starts: a bad certificate or token file stops the start.
    let acceptor = tls::Acceptor::new(&cfg.grpc_tls, metrics.grpc_connections_refused.clone())?;
    let access = crate::api::auth::Access {
        token: crate::api::auth::ApiToken::load(cfg.api_token_file.as_deref())?,
        refused: metrics.http_unauthorized.clone(),
    };
    let pool = PoolRef {
        name: cfg.pool_name.clone(),
        namespace: cfg.pool_namespace.clone(),
        service: cfg.endpoint_service().to_owned(),
        picker_service: cfg.endpoint_picker_service.clone(),
    };
    let gauge = metrics.ready_endpoints.clone();
    let store = Arc::new(Datastore::new(pool, move |snap| {
        gauge.set(snap.endpoints.len() as i64);
    }));
    // Before anything is spawned: a refused start leaves nothing running.
    check_cluster_topology(&cfg).await?;
    let (stop_tx, stop_rx) = watch::channel(false);

    let mut tasks = Vec::new();
    // The catalog (pools, models) goes straight to the store; endpoints only through the
    // ServiceDiscovery interface.
    let discovery: Arc<dyn ServiceDiscovery> = match &cfg.manifests_dir {
        Some(dir) => {
            let errors = metrics.manifest_errors.clone();
            let source = ManifestDir::new(
                dir,
                Duration::from_millis(cfg.manifests_poll_ms),
                move |_| {
                    errors.inc();
                },
            );
            let discovery = source.discovery();
            tasks.push(source.spawn(store.clone(), stop_rx.clone()));
            Arc::new(discovery)
        }
        None => {
            let client = crate::discovery::kubernetes::client(cfg.kubeconfig.as_deref()).await?;
            tracing::info!(namespace = %cfg.pool_namespace, pool = %cfg.pool_name,
                service = %cfg.endpoint_service(), "discovering from the Kubernetes API");
            let invalid = metrics.catalog_invalid.clone();
            let catalog = KubeCatalog {
                client: client.clone(),
                namespace: cfg.pool_namespace.clone(),
                metrics: metrics.watch.clone(),
                on_invalid: Box::new(move || {
                    invalid.inc();
                }),
            };
            tasks.push(tokio::spawn(catalog.run(store.clone(), stop_rx.clone())));
            Arc::new(KubeDiscovery::new(client, metrics.watch.clone()))
        }
    };
    let replica_discovery = discovery.clone();
    tasks.push(tokio::spawn(feed_instances(
        store.clone(),
        discovery,
        stop_rx.clone(),
    )));

    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    {
        let reporter = reporter.clone();
        let mut ready = store.ready();
        let mut stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let status = if *ready.borrow_and_update() && !*stop.borrow() {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                for svc in ["readiness", EXT_PROC_SERVICE, ""] {
                    reporter.set_service_status(svc, status).await;
                }
                tokio::select! {
                    r = ready.changed() => if r.is_err() { return },
                    _ = stop.changed() => {}
                }
            }
        }));
    }

    let em = &cfg.engine_metrics;
    let saturation = Saturation {
        max_in_flight: cfg.max_in_flight_per_endpoint,
        queue_threshold: em.queue_threshold,
        kv_cache_threshold: em.kv_cache_threshold,
        stale_after: em.enabled.then(|| Duration::from_millis(em.stale_after_ms)),
    };
    let md = Arc::new(MetadataStore::default());
    let kv = match cfg.picker {
        PickerKind::LeastLoaded | PickerKind::RoundRobin => None,
        PickerKind::KvAware | PickerKind::ApproximatePrefix => {
            let approximate_only = cfg.picker == PickerKind::ApproximatePrefix;
            let kv = Arc::new(KvState::new(KvSettings {
                block_size: cfg.block_size.unwrap_or(KvSettings::default().block_size),
                learn_block_size: cfg.block_size.is_none(),
                weights: cfg.router,
                approx_blocks_per_endpoint: cfg.approx_blocks_per_endpoint,
                approximate_only,
                // Prompts are untrusted: key the index tables randomly per process.
                table_seed: fastrand::u64(..),
                prefix_closed: cfg.kv_events.prefix_closed,
                ..KvSettings::default()
            }));
            // Approximate prefix routing never reads the engines' KV events.
            if !approximate_only {
                tasks.push(tokio::spawn(crate::kv_events::apply::run_manager(
                    kv.clone(),
                    store.watch(),
                    md.clone(),
                    cfg.kv_events.clone(),
                    metrics.clone(),
                    stop_rx.clone(),
                )));
            }
            Some(kv)
        }
    };
    {
        // Every picker reads the endpoints' metadata: roles and topology for disaggregated
        // pools; block size, base model (and KV-event sockets) for the KV-aware one.
        let learn = kv.clone();
        let facts_store = store.clone();
        tasks.push(tokio::spawn(crate::engine::metadata::run_fetcher(
            store.watch(),
            md.clone(),
            cfg.engine_metadata,
            move |addr, doc| {
                facts_store.apply_metadata(
                    addr,
                    doc.map(|d| EndpointFacts {
                        role: d.role_kind(),
                        domains: d.topology_domains.clone(),
                    }),
                );
                let (Some(doc), Some(kv)) = (doc, &learn) else {
                    return;
                };
                if let Some(bs) = doc.block_size() {
                    kv.learn_block_size(bs);
                }
                if let Some(name) = doc.model_name() {
                    kv.learn_base_model(name);
                }
            },
            metrics.metadata_missing.clone(),
            stop_rx.clone(),
        )));
    }
    if em.enabled {
        let learn = kv.clone();
        let tracked = kv.clone();
        let pool_store = store.clone();
        tasks.push(tokio::spawn(crate::engine::metrics::run_scraper(
            store.watch(),
            // The InferencePool's appProtocol says how the engines speak HTTP.
            move || {
                let snap = pool_store.snapshot();
                snap.pool
                    .as_ref()
                    .map(|p| p.app_protocol)
                    .unwrap_or_default()
            },
            crate::engine::metrics::ScrapeSettings {
                interval: Duration::from_millis(em.interval_ms),
                timeout: Duration::from_millis(em.timeout_ms),
                max_bytes: em.max_page_bytes,
            },
            metrics.engine_scrape_errors.clone(),
            move |bs| {
                if let Some(kv) = &learn {
                    kv.learn_block_size(bs);
                }
            },
            move |worker| tracked.as_ref().and_then(|kv| kv.worker_requests(worker)),
            stop_rx.clone(),
        )));
    }
    if let (Some(kv), false) = (&kv, cfg.replica_sync.indexer_peers.is_empty()) {
        // Before any ext_proc stream is served, once the pool is loaded (the upkeep forgets the
        // state of endpoints not in the pool, so it must know them first).
        let mut ready = store.ready();
        let wait = Duration::from_millis(cfg.startup_wait_ms);
        let _ = tokio::time::timeout(wait, ready.wait_for(|r| *r)).await;
        if let Err(e) =
            crate::replica::recovery::recover_pool(kv, &cfg.replica_sync.indexer_peers).await
        {
            tracing::warn!(error = %e, "starting without a recovered KV index");
        }
    }
    let router = Arc::new(
        match (&kv, cfg.picker) {
            (Some(kv), _) => Router::kv_aware(kv.clone(), saturation),
            (None, PickerKind::RoundRobin) => {
                Router::load_only(Box::new(RoundRobin::default()), saturation)
            }
            (None, _) => Router::load_only(Box::new(LeastLoaded), saturation),
        }
        .with_disaggregation(cfg.disaggregation.clone()),
    );
    tasks.push(tokio::spawn(crate::upkeep::run(
        router.clone(),
        store.watch(),
        stop_rx.clone(),
    )));
    let mut routing = RequestRouter::new(
        store.clone(),
        router.clone(),
        cfg.unknown_models == UnknownModels::PassThrough,
    )
    .with_steps(metrics.prepare_steps.clone());
    for (model, dir) in &cfg.tokenizers {
        let t = ModelTokenizer::load(dir).map_err(|source| ServerError::Tokenizer {
            model: model.clone(),
            source,
        })?;
        tracing::info!(model = %model, dir = %dir.display(), tokenizer = ?t, "tokenizer loaded");
        let t = Arc::new(t);
        metrics.add_tokenizer_source(tokenizer_source(model, &t));
        routing = routing.with_tokenizer(model.clone(), t);
    }
    let settings = Settings {
        destination_list: cfg.destination_endpoint_list,
        max_body_bytes: cfg.max_body_bytes,
        ready_wait: Duration::from_millis(cfg.startup_wait_ms),
        endpoint_scores: cfg.emit_endpoint_scores,
    };
    let routing: Arc<dyn crate::request::RouteRequest> = Arc::new(routing);
    let mut shared =
        Shared::new(routing.clone(), metrics.clone(), settings).with_readiness(store.ready());
    if cfg.flow_control.enabled {
        let flow = FlowControl::new(cfg.flow_control.clone(), metrics.flow.clone());
        // Every booking's release wakes the dispatcher: capacity may have freed.
        router.listen(flow.clone());
        tasks.push(tokio::spawn(
            flow.clone().dispatch(routing.clone(), stop_rx.clone()),
        ));
        // Endpoints joining the pool are capacity too.
        let mut changes = store.watch();
        let wake = flow.clone();
        let mut stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    c = changes.changed() => if c.is_err() { return },
                    _ = stop.changed() => return,
                }
                wake.capacity_freed();
            }
        }));
        shared = shared.with_flow_control(flow);
    }
    let shared = Arc::new(shared);
    let extproc = ExtProcService::new(shared).into_server();

    let [g, h, m] = listeners.addrs();
    tracing::info!(ext_proc = ?g, health = ?h, metrics = ?m, "kvepp serving");
    // Replica sync's counters, registered by replica sync itself.
    let sync_stats = Arc::new(crate::replica::SyncStats::default());
    metrics.add(&*sync_stats);
    let doors = match &kv {
        Some(_) => {
            crate::server::shared::start(
                &cfg,
                &router,
                &store,
                replica_discovery,
                (listeners.select_service, listeners.slot_tracker),
                &access,
                sync_stats,
                &stop_rx,
                &mut tasks,
            )
            .await?
        }
        None => Vec::new(),
    };

    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let window = (cfg.max_body_bytes as u32).clamp(GRPC_WINDOW.0, GRPC_WINDOW.1);
    tracing::info!(tls = ?cfg.grpc_tls.mode, plaintext = cfg.grpc_tls.accept_plaintext,
        mutual = cfg.grpc_tls.client_ca_file.is_some(), "ext_proc transport");
    let grpc = tonic::transport::Server::builder()
        .initial_stream_window_size(window)
        .initial_connection_window_size(window.saturating_mul(4))
        .add_service(extproc)
        .serve_with_incoming_shutdown(acceptor.incoming(listeners.grpc), stopped(stop_rx.clone()));
    let health = tonic::transport::Server::builder()
        .add_service(health_service)
        .serve_with_incoming_shutdown(incoming(listeners.health), stopped(stop_rx.clone()));
    let http = axum::serve(
        listeners.metrics,
        api::router(ApiState { metrics, store, kv }, &access),
    )
    .with_graceful_shutdown(stopped(stop_rx.clone()));

    let grpc = tokio::spawn(grpc);
    let health = tokio::spawn(health);
    let http = tokio::spawn(async move {
        let (main, doors) = tokio::join!(http, futures::future::join_all(doors));
        let doors = doors.into_iter().try_for_each(|d| match d {
            Ok(r) => r,
            Err(e) => Err(std::io::Error::other(e)),
        });
        main.and(doors)
    });

    shutdown.await;
    tracing::info!(
        grace_seconds = cfg.shutdown_grace_seconds,
        "shutting down: not ready, no new connections, finishing open streams"
    );
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs(cfg.shutdown_grace_seconds);
    let drained = tokio::time::timeout(grace, async {
        let (a, b, c) = tokio::join!(grpc, health, http);
        (a, b, c)
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
            .select_service
            .as_ref()
            .and_then(|l| l.local_addr().ok());
        let slot_tracker = listeners
            .slot_tracker
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
