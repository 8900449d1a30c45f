//! `kvepp serve`'s components, each started from its own section of the configuration: discovery
//! (manifests or the Kubernetes API), the gRPC health reporter, the KV-aware state with its
//! KV-event subscriptions, engine metadata and metrics scraping, the router, index recovery from
//! a peer, the router's upkeep (only once the recovery is done), the routing service with its
//! tokenizers, and flow control. [`super::run`] lists them in order; each registers its metrics
//! and pushes the tasks it spawns onto the shared list, which shutdown aborts.
//!
//! Invariant: a component reads its settings from the tree and nothing else; its tasks stop when
//! the stop signal turns true (or are aborted after the grace period).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic_health::ServingStatus;

use super::{ServerError, EXT_PROC_SERVICE};
use crate::admission::flow::FlowMetrics;
use crate::admission::FlowControl;
use crate::config::{Config, PickerKind, UnknownModels};
use crate::discovery::kubernetes::{KubeCatalog, KubeDiscovery};
use crate::discovery::{Datastore, EndpointFacts, ManifestDir, ServiceDiscovery};
use crate::engine::metadata::MetadataStore;
use crate::engine::metrics::ScrapeSettings;
use crate::kv_events::apply::KvEventMetrics;
use crate::metrics::Metrics;
use crate::routing::{RequestRouter, RouteRequest};
use kvepp_core::{KvSettings, KvState, LeastLoaded, RoundRobin, Router, Saturation};
use kvepp_tokenizer::ModelTokenizer;

/// What the components share while they start: the tree, the metrics, the pool's datastore, the
/// stop signal and the tasks spawned so far.
pub(super) struct Wiring {
    pub cfg: Config,
    pub metrics: Arc<Metrics>,
    pub store: Arc<Datastore>,
    pub stop: watch::Receiver<bool>,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Discovery's and the engine readers' counters (registered by [`Wiring::new`]).
    pub discovery: crate::discovery::DiscoveryCounters,
    pub engines: crate::engine::EngineCounters,
    /// The engine scraper's settings (a reload sends new ones).
    pub scrape: watch::Sender<ScrapeSettings>,
    /// True from SIGTERM on: not ready, still serving until the listeners close.
    pub draining: watch::Sender<bool>,
}

/// When an endpoint counts as saturated, from the tree (at start and on a reload).
pub(super) fn saturation(cfg: &Config) -> Saturation {
    let em = &cfg.engine_metrics;
    Saturation {
        max_in_flight: cfg.max_in_flight_per_endpoint,
        queue_threshold: em.queue_threshold,
        kv_cache_threshold: em.kv_cache_threshold,
        stale_after: em.enabled.then(|| Duration::from_millis(em.stale_after_ms)),
    }
}

/// The router's saturation limits and adapter weights, from the tree.
pub(super) fn tuning(cfg: &Config) -> kvepp_core::Tuning {
    kvepp_core::Tuning {
        saturation: saturation(cfg),
        adapters: cfg.adapter_affinity,
    }
}

/// How the engine scraper runs, from the tree.
pub(super) fn scrape_settings(cfg: &Config) -> ScrapeSettings {
    let em = &cfg.engine_metrics;
    ScrapeSettings {
        interval: Duration::from_millis(em.interval_ms),
        timeout: Duration::from_millis(em.timeout_ms),
        max_bytes: em.max_page_bytes,
        engine: em.engine.fixed(),
    }
}

/// The ext_proc door's protocol settings, from the tree.
pub(super) fn extproc_settings(cfg: &Config) -> crate::extproc::Settings {
    crate::extproc::Settings {
        destination_list: cfg.destination_endpoint_list,
        max_body_bytes: cfg.max_body_bytes,
        ready_wait: Duration::from_millis(cfg.startup_wait_ms),
        endpoint_scores: cfg.emit_endpoint_scores,
    }
}

/// Loads `model`'s tokenizer from `dir` and has `metrics` report its counts (at start and on a
/// reload).
pub(super) fn load_tokenizer(
    metrics: &Metrics,
    model: &str,
    dir: &std::path::Path,
) -> Result<Arc<ModelTokenizer>, ServerError> {
    let t = ModelTokenizer::load(dir).map_err(|source| ServerError::Tokenizer {
        model: model.to_owned(),
        source,
    })?;
    tracing::info!(model = %model, dir = %dir.display(), tokenizer = ?t, "tokenizer loaded");
    let t = Arc::new(t);
    metrics.add_tokenizer_source(super::tokenizer_source(model, &t));
    Ok(t)
}

impl Wiring {
    /// The shared part of the components' start; discovery and the engine readers register
    /// their counters here.
    pub(crate) fn new(
        cfg: Config,
        metrics: Arc<Metrics>,
        store: Arc<Datastore>,
        stop: watch::Receiver<bool>,
        discovery: crate::discovery::DiscoveryCounters,
    ) -> Self {
        let engines = crate::engine::EngineCounters::default();
        metrics.add(&discovery);
        metrics.add(&engines);
        Wiring {
            scrape: watch::channel(scrape_settings(&cfg)).0,
            draining: watch::channel(false).0,
            cfg,
            metrics,
            store,
            stop,
            tasks: Vec::new(),
            discovery,
            engines,
        }
    }

    /// Discovery: the catalog (pools, models) goes straight to the store; endpoints only through
    /// the returned [`ServiceDiscovery`].
    pub(crate) async fn discovery(&mut self) -> Result<Arc<dyn ServiceDiscovery>, ServerError> {
        let discovery: Arc<dyn ServiceDiscovery> = match &self.cfg.manifests_dir {
            Some(dir) => {
                let errors = self.discovery.manifest_errors.clone();
                let source = ManifestDir::new(
                    dir,
                    Duration::from_millis(self.cfg.manifests_poll_ms),
                    move |_| {
                        errors.inc();
                    },
                );
                let discovery = source.discovery();
                self.tasks
                    .push(source.spawn(self.store.clone(), self.stop.clone()));
                Arc::new(discovery)
            }
            None => {
                let client =
                    crate::discovery::kubernetes::client(self.cfg.kubeconfig.as_deref()).await?;
                tracing::info!(namespace = %self.cfg.pool_namespace, pool = %self.cfg.pool_name,
                    service = %self.cfg.endpoint_service(), "discovering from the Kubernetes API");
                let invalid = self.discovery.catalog_invalid.clone();
                // The watches register their own counters.
                let watches = crate::discovery::kubernetes::WatchMetrics::default();
                self.metrics.add(&watches);
                let catalog = KubeCatalog {
                    client: client.clone(),
                    namespace: self.cfg.pool_namespace.clone(),
                    metrics: watches.clone(),
                    on_invalid: Box::new(move || {
                        invalid.inc();
                    }),
                };
                self.tasks.push(tokio::spawn(
                    catalog.run(self.store.clone(), self.stop.clone()),
                ));
                Arc::new(KubeDiscovery::new(client, watches))
            }
        };
        Ok(discovery)
    }

    /// The gRPC health reporter: `liveness` at once, `readiness` (and the ext_proc service) while
    /// the pool is loaded and kvepp is not draining (from SIGTERM on).
    pub(crate) async fn health(
        &mut self,
    ) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>
    {
        let (reporter, health_service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("liveness", ServingStatus::Serving)
            .await;
        {
            let reporter = reporter.clone();
            let mut ready = self.store.ready();
            let mut draining = self.draining.subscribe();
            self.tasks.push(tokio::spawn(async move {
                loop {
                    let status = if *ready.borrow_and_update() && !*draining.borrow() {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    for svc in ["readiness", EXT_PROC_SERVICE, ""] {
                        reporter.set_service_status(svc, status).await;
                    }
                    tokio::select! {
                        r = ready.changed() => if r.is_err() { return },
                        r = draining.changed() => if r.is_err() { return },
                    }
                }
            }));
        }
        health_service
    }

    /// The KV-aware state (none for a load-only picker), with its KV-event subscriptions; their
    /// counters are registered whatever the picker.
    pub(crate) fn kv_state(&mut self, md: &Arc<MetadataStore>) -> Option<Arc<KvState>> {
        let kv_events = Arc::new(KvEventMetrics::default());
        self.metrics.add(&*kv_events);
        match self.cfg.picker {
            PickerKind::LeastLoaded | PickerKind::RoundRobin => None,
            PickerKind::KvAware | PickerKind::ApproximatePrefix => {
                let approximate_only = self.cfg.picker == PickerKind::ApproximatePrefix;
                let kv = Arc::new(KvState::new(KvSettings {
                    block_size: self
                        .cfg
                        .block_size
                        .unwrap_or(KvSettings::default().block_size),
                    learn_block_size: self.cfg.block_size.is_none(),
                    weights: self.cfg.router,
                    approx_blocks_per_endpoint: self.cfg.approx_blocks_per_endpoint,
                    approximate_only,
                    // Prompts are untrusted: key the index tables randomly per process.
                    table_seed: fastrand::u64(..),
                    prefix_closed: self.cfg.kv_events.prefix_closed,
                    ..KvSettings::default()
                }));
                // Approximate prefix routing never reads the engines' KV events.
                if !approximate_only {
                    self.tasks
                        .push(tokio::spawn(crate::kv_events::apply::run_manager(
                            kv.clone(),
                            self.store.watch(),
                            md.clone(),
                            self.cfg.kv_events.clone(),
                            kv_events,
                            self.stop.clone(),
                        )));
                }
                Some(kv)
            }
        }
    }

    /// Fetching every endpoint's `/metadata`: roles and topology, block size and base model.
    pub(crate) fn engine_metadata(&mut self, kv: &Option<Arc<KvState>>, md: &Arc<MetadataStore>) {
        {
            // Every picker reads the endpoints' metadata: roles and topology for disaggregated
            // pools; block size, base model (and KV-event sockets) for the KV-aware one.
            let learn = kv.clone();
            let facts_store = self.store.clone();
            self.tasks
                .push(tokio::spawn(crate::engine::metadata::run_fetcher(
                    self.store.watch(),
                    md.clone(),
                    self.cfg.engine_metadata,
                    move |addr, doc| {
                        facts_store.apply_metadata(
                            addr,
                            doc.map(|d| EndpointFacts {
                                role: d.role_kind(),
                                domains: d.topology_domains.clone(),
                            }),
                        );
                        if let Some(slots) = doc.and_then(|d| d.adapters()) {
                            let snap = facts_store.snapshot();
                            if let Some(e) = snap.endpoints.iter().find(|e| e.addr == addr) {
                                e.load.set_metadata_adapters(slots);
                            }
                        }
                        let (Some(doc), Some(kv)) = (doc, &learn) else {
                            return;
                        };
                        if let Some(bs) = doc.block_size() {
                            kv.learn_block_size(kvepp_core::kv::worker_id(&addr.to_string()), bs);
                        }
                        if let Some(name) = doc.model_name() {
                            kv.learn_base_model(name);
                        }
                        if let Some(blocks) = doc.total_kv_blocks() {
                            let snap = facts_store.snapshot();
                            for e in snap.endpoints.iter().filter(|e| e.addr == addr) {
                                kv.set_engine_capacity(e.rank(), blocks);
                            }
                        }
                    },
                    self.engines.metadata_missing.clone(),
                    self.stop.clone(),
                )));
        }
    }

    /// Scraping every engine's `/metrics` (saturation, block size, hidden load).
    pub(crate) fn engine_scraper(&mut self, kv: &Option<Arc<KvState>>) {
        if self.cfg.engine_metrics.enabled {
            let pool_store = self.store.clone();
            self.tasks
                .push(tokio::spawn(crate::engine::metrics::run_scraper(
                    self.store.watch(),
                    // The InferencePool's appProtocol says how the engines speak HTTP.
                    move || {
                        let snap = pool_store.snapshot();
                        snap.pool
                            .as_ref()
                            .map(|p| p.app_protocol)
                            .unwrap_or_default()
                    },
                    self.scrape.subscribe(),
                    self.engines.clone(),
                    kv.clone(),
                    self.stop.clone(),
                )));
        }
    }

    /// Before any ext_proc stream is served: the KV index from a peer's `/dump`, once the pool is
    /// loaded (the upkeep, started after, forgets the state of endpoints not in the pool, so the
    /// pool must list the recovered ones).
    pub(crate) async fn recover_index(&self, kv: &Option<Arc<KvState>>, router: &Router) {
        if let (Some(kv), false) = (&kv, self.cfg.replica_sync.indexer_peers.is_empty()) {
            let mut ready = self.store.ready();
            let wait = Duration::from_millis(self.cfg.startup_wait_ms);
            let _ = tokio::time::timeout(wait, ready.wait_for(|r| *r)).await;
            let counters = crate::replica::recovery::RecoveryMetrics::default();
            self.metrics.add(&counters);
            let outcome = crate::replica::recovery::recover_pool(
                kv,
                router,
                &self.cfg.replica_sync.indexer_peers,
            )
            .await;
            counters.observe(&outcome);
            if let Err(e) = outcome {
                tracing::warn!(error = %e, "starting without a recovered KV index");
            }
        }
    }

    /// The router: the picker, saturation limits and disaggregation from the tree (its upkeep is
    /// [`Self::upkeep`]).
    pub(crate) fn router(&self, kv: &Option<Arc<KvState>>) -> Arc<Router> {
        let saturation = saturation(&self.cfg);
        Arc::new(
            match (&kv, self.cfg.picker) {
                (Some(kv), _) => Router::kv_aware(kv.clone(), saturation),
                (None, PickerKind::RoundRobin) => {
                    Router::load_only(Box::new(RoundRobin::default()), saturation)
                }
                (None, _) => Router::load_only(Box::new(LeastLoaded), saturation),
            }
            .with_disaggregation(self.cfg.disaggregation.clone())
            .with_adapter_affinity(self.cfg.adapter_affinity)
            .with_sessions(self.cfg.session_affinity.table()),
        )
    }

    /// The router's upkeep, following the pool. Started after [`Self::recover_index`]: an upkeep
    /// pass that read the pool before it was loaded must not run after the recovered index is in
    /// place (it would forget every endpoint the pool was about to list).
    pub(crate) fn upkeep(&mut self, router: &Arc<Router>) {
        self.tasks.push(tokio::spawn(crate::upkeep::run(
            router.clone(),
            self.store.watch(),
            self.stop.clone(),
        )));
    }

    /// The routing service over `router`, with the tokenizers of the tree.
    pub(crate) fn routing(
        &mut self,
        router: &Arc<Router>,
    ) -> Result<Arc<RequestRouter>, ServerError> {
        let mut routing = RequestRouter::new(
            self.store.clone(),
            router.clone(),
            self.cfg.unknown_models == UnknownModels::PassThrough,
        )
        .with_steps(self.metrics.prepare_steps.clone())
        .with_id_counts(&self.metrics.prompt_token_ids)
        .with_unknown_paths(self.metrics.unknown_paths.clone());
        for (model, dir) in &self.cfg.tokenizers {
            let t = load_tokenizer(&self.metrics, model, dir)?;
            routing = routing.with_tokenizer(model.clone(), t);
        }
        Ok(Arc::new(routing))
    }

    /// Flow control: it listens to the router's releases, and endpoints joining the pool wake
    /// it too. It runs whether enabled or not (a reload may turn it on); requests queue only
    /// while it is enabled.
    pub(crate) fn flow_control(
        &mut self,
        router: &Arc<Router>,
        routing: &Arc<dyn RouteRequest>,
    ) -> Arc<FlowControl> {
        let counters = FlowMetrics {
            pool: self.cfg.pool_name.as_str().into(),
            ..FlowMetrics::default()
        };
        self.metrics.add(&counters);
        let flow = FlowControl::new(self.cfg.flow_control.clone(), counters);
        // Every booking's release wakes the dispatcher: capacity may have freed.
        router.listen(flow.clone());
        self.tasks.push(tokio::spawn(
            flow.clone().dispatch(routing.clone(), self.stop.clone()),
        ));
        // Endpoints joining the pool are capacity too.
        let mut changes = self.store.watch();
        let wake = flow.clone();
        let mut stop = self.stop.clone();
        self.tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    c = changes.changed() => if c.is_err() { return },
                    _ = stop.changed() => return,
                }
                wake.capacity_freed();
            }
        }));
        flow
    }

    /// The ext_proc door's shared state: the routing service, readiness, the session header and
    /// affinity counters, flow control and, with `traced`, a span per decision.
    pub(crate) fn ext_proc_door(
        &mut self,
        router: &Arc<Router>,
        routing: Arc<dyn RouteRequest>,
        flow: &Arc<FlowControl>,
        traced: bool,
    ) -> Arc<crate::extproc::Shared> {
        let affinity = Arc::new(crate::routing::Affinity::new(
            Some(&self.cfg.session_affinity.header),
            Some(router.clone()),
        ));
        self.metrics.add(&*affinity);
        let settings = extproc_settings(&self.cfg);
        let limit_counters = crate::admission::rate_limit::RateLimitMetrics::default();
        self.metrics.add(&limit_counters);
        let limits = Arc::new(crate::admission::RateLimiter::new(
            self.cfg.rate_limits.clone(),
            limit_counters,
        ));
        let mut shared = crate::extproc::Shared::new(routing, self.metrics.clone(), settings)
            .with_readiness(self.store.ready())
            .with_affinity(affinity)
            .with_rate_limits(limits)
            .with_flow_control(flow.clone());
        if traced {
            shared = shared.with_tracing(Arc::new(crate::extproc::TraceInfo {
                pool: format!("{}/{}", self.cfg.pool_namespace, self.cfg.pool_name).into(),
                picker: self.cfg.picker.as_str(),
                router: router.clone(),
            }));
        }
        Arc::new(shared)
    }
}
