//! Applies decoded KV-event batches of one worker to the prefix index, and the task that keeps one
//! subscription per publishing rank of every ready endpoint ([`run_manager`]), driven by the pool's
//! and the metadata's changes.
//!
//! Invariants: a batch is applied under one write lock of the index (never half-applied); an
//! endpoint that leaves the pool has its subscriptions stopped (its blocks are forgotten by the
//! router's upkeep); a publisher restart or a loss (batches that could not be replayed) clears the
//! ranks that publisher published for, and only those, so no entry outlives a removal kvepp
//! missed: the index then holds what the batches delivered after it build. The one exception is
//! a subscription's opening gap (it joined a publisher already past batch 0 and could not replay
//! from 0): nothing that subscription delivered can be stale, so what the index already holds for
//! the rank (a peer's dump recovered at start) is kept and built on.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use super::subscriber::{self, Delivery, Source, SubscriberStats, Timing};
use super::KvEventsConfig;
use super::{EventBatch, KvEvent};
use crate::engine::metadata::{EngineMetadata, MetadataStore};
use crate::metrics::{EndpointLabels, ReasonLabels, Register};
use kvepp_core::hash::local_block_hashes;
use kvepp_core::index::{IndexError, PrefixIndex};
use kvepp_core::kv::KvState;
use kvepp_core::slots::WorkerRank;
use kvepp_core::Endpoint;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// What applying one batch did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub stored: u64,
    pub removed: u64,
    /// Events not applied, by reason.
    pub dropped: Vec<&'static str>,
}

/// Applies `batch` from `worker` (rank from the batch, else `default_rank`). Events whose block
/// size differs from ours are dropped: their hashes could never match a request's.
pub fn apply_batch(
    index: &mut PrefixIndex,
    worker: u64,
    default_rank: u32,
    block_size: u32,
    batch: &EventBatch,
) -> Applied {
    let rank = WorkerRank {
        worker,
        dp_rank: batch.data_parallel_rank.unwrap_or(default_rank),
    };
    let mut out = Applied::default();
    for event in &batch.events {
        match event {
            KvEvent::Stored {
                block_hashes,
                parent,
                token_ids,
                block_size: bs,
                lora_name,
                tier,
            } => {
                if *bs != block_size {
                    out.dropped.push("block_size_mismatch");
                    continue;
                }
                let locals = local_block_hashes(token_ids, *bs as usize, lora_name.as_deref());
                let blocks = block_hashes.iter().copied().zip(locals);
                match index.store(rank, *tier, *parent, blocks) {
                    Ok(n) => out.stored += n as u64,
                    Err(e) => {
                        tracing::debug!(worker, dp_rank = rank.dp_rank, error = %e, "KV event not applied");
                        out.dropped.push(match e {
                            IndexError::UnknownParent { .. } => "unknown_parent",
                            IndexError::RankFull { .. } => "rank_full",
                            IndexError::TooManyRanks => "too_many_ranks",
                        });
                    }
                }
            }
            KvEvent::Removed { block_hashes, tier } => {
                out.removed += index.remove(rank, *tier, block_hashes.iter().copied()) as u64;
            }
            KvEvent::AllCleared => index.clear_rank(rank),
        }
    }
    out
}

/// Where one endpoint's ranks publish: its `/metadata` `kv_events` when it has them, else
/// `tcp://<address>:<port>` (rank 0) when KV events are enabled in the configuration. An endpoint
/// that is one data-parallel rank of its pod (a pool with several target ports) takes only its own
/// rank's publisher: the metadata's entry for it, else the configured port plus the rank.
fn sources_of(
    ep: &Endpoint,
    md: Option<&EngineMetadata>,
    cfg: &KvEventsConfig,
) -> Vec<(u32, Source)> {
    let from_md: Vec<(u32, Source)> = md
        .map(|m| m.kv_event_sources())
        .unwrap_or_default()
        .into_iter()
        .map(|(rank, endpoint, replay_endpoint)| {
            (
                rank,
                Source {
                    endpoint,
                    replay_endpoint,
                    topic: cfg.topic.clone(),
                },
            )
        })
        .filter(|(rank, _)| ep.dp_rank.is_none_or(|own| own == *rank))
        .collect();
    if !from_md.is_empty() || !cfg.enabled {
        return from_md;
    }
    let rank = ep.dp_rank.unwrap_or(0);
    let offset = |port: u16| u16::try_from(rank).ok().and_then(|r| port.checked_add(r));
    // SocketAddr's Display brackets IPv6 addresses, as ZMQ endpoints need.
    let at = |port| format!("tcp://{}", std::net::SocketAddr::new(ep.addr.ip(), port));
    let Some(port) = offset(cfg.port) else {
        return Vec::new();
    };
    vec![(
        rank,
        Source {
            endpoint: at(port),
            replay_endpoint: cfg.replay_port.and_then(offset).map(at),
            topic: cfg.topic.clone(),
        },
    )]
}

/// One endpoint's running subscriptions and what they were started for.
struct Running {
    sources: Vec<(u32, Source)>,
    stops: Vec<watch::Sender<bool>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for s in &self.stops {
            let _ = s.send(true);
        }
    }
}

/// Time from a KV-event batch's arrival to its publication in the index picks read: 50 µs to
/// about 3 s.
#[derive(Debug, Clone)]
pub struct ApplyLag(pub prometheus_client::metrics::histogram::Histogram);

impl Default for ApplyLag {
    fn default() -> Self {
        ApplyLag(prometheus_client::metrics::histogram::Histogram::new(
            prometheus_client::metrics::histogram::exponential_buckets(50e-6, 2.0, 17),
        ))
    }
}

/// KV-event ingestion, summed over every subscription.
#[derive(Debug, Default)]
pub struct KvEventMetrics {
    /// From a batch's arrival to the publication that makes it visible to picks.
    pub apply_lag: ApplyLag,
    pub batches: Family<EndpointLabels, Counter>,
    pub undecodable: Counter,
    pub lost_batches: Counter,
    pub publisher_restarts: Counter,
    /// Subscriptions whose publisher has no replay socket (no catch-up possible).
    pub without_replay: Counter,
    pub blocks_stored: Counter,
    pub blocks_removed: Counter,
    /// Pairs the index dropped, oldest first, to keep a rank within its engine's capacity.
    pub index_evicted: Counter,
    pub dropped: Family<ReasonLabels, Counter>,
    /// 1 for an endpoint whose KV events are not read (they stopped decoding, or its block size
    /// is not the pool's): matched by what was routed to it meanwhile; 0 once that ends.
    pub fallback: Family<EndpointLabels, Gauge>,
    pub index_blocks: Gauge,
    pub index_pairs: Gauge,
    pub index_memory_bytes: Gauge,
    pub subscriptions: Gauge,
    pub block_size: Gauge,
}

impl KvEventMetrics {
    /// One batch published: its lag since `received`, its counters.
    fn observe_applied(&self, labels: &EndpointLabels, applied: &Applied, received: Instant) {
        self.apply_lag.0.observe(received.elapsed().as_secs_f64());
        self.batches.get_or_create(labels).inc();
        self.blocks_stored.inc_by(applied.stored);
        self.blocks_removed.inc_by(applied.removed);
        for &reason in &applied.dropped {
            self.dropped.get_or_create(&ReasonLabels { reason }).inc();
        }
    }
}

impl Register for KvEventMetrics {
    fn register(&self, registry: &mut Registry) {
        for (name, help, metric) in [
            (
                "kv_event_undecodable",
                "KV-event messages that could not be decoded (dropped)",
                &self.undecodable,
            ),
            (
                "kv_event_lost_batches",
                "KV-event batches missed and not replayable",
                &self.lost_batches,
            ),
            (
                "kv_event_publisher_restarts",
                "KV-event publishers seen restarting (their blocks cleared)",
                &self.publisher_restarts,
            ),
            (
                "kv_event_publishers_without_replay",
                "KV-event subscriptions whose publisher has no replay socket (no catch-up)",
                &self.without_replay,
            ),
            (
                "kv_event_blocks_stored",
                "Blocks stored by KV events",
                &self.blocks_stored,
            ),
            (
                "kv_event_blocks_removed",
                "Blocks removed by KV events",
                &self.blocks_removed,
            ),
            (
                "kv_index_evicted_blocks",
                "(block, worker rank) pairs dropped, oldest first, because the rank held more than its engine's reported KV capacity plus the margin (a publisher that missed removals)",
                &self.index_evicted,
            ),
        ] {
            registry.register(name, help, metric.clone());
        }
        registry.register(
            "kv_event_batches",
            "KV-event batches applied, by endpoint",
            self.batches.clone(),
        );
        registry.register(
            "kv_event_apply_lag_seconds",
            "Time from a KV-event batch's arrival to its publication in the index picks read (batches arriving together share one publication; the writer never waits for readers of the copy it just left)",
            self.apply_lag.0.clone(),
        );
        registry.register(
            "kv_events_dropped",
            "KV events not applied, by reason",
            self.dropped.clone(),
        );
        registry.register(
            "kv_events_fallback",
            "1 while an endpoint's KV events are not read (they do not decode, or its block size differs from the pool's): its cached prefix is then what kvepp routed to it (approximate matching)",
            self.fallback.clone(),
        );
        for (name, help, metric) in [
            (
                "kv_index_blocks",
                "Distinct blocks in the KV prefix index",
                &self.index_blocks,
            ),
            (
                "kv_index_pairs",
                "(block, worker rank) pairs in the KV prefix index",
                &self.index_pairs,
            ),
            (
                "kv_index_memory_bytes",
                "Bytes held by the KV prefix index's tables",
                &self.index_memory_bytes,
            ),
            (
                "kv_event_subscriptions",
                "KV-event subscriptions running",
                &self.subscriptions,
            ),
            (
                "kv_block_size",
                "Tokens per KV block in use (configured, or learned from the engines)",
                &self.block_size,
            ),
        ] {
            registry.register(name, help, metric.clone());
        }
    }
}

/// Keeps one subscription per publishing rank of every ready endpoint (re-subscribing when its
/// metadata changes, stopping when it leaves the pool) and refreshes the index gauges.
pub(crate) async fn run_manager(
    kv: Arc<KvState>,
    mut pool: watch::Receiver<Arc<[Arc<Endpoint>]>>,
    md: Arc<MetadataStore>,
    cfg: KvEventsConfig,
    metrics: Arc<KvEventMetrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut subs: HashMap<Arc<str>, Running> = HashMap::new();
    // Endpoints whose fallback gauge has been shown (kept at 0 once it ends, removed when they
    // leave the pool).
    let mut shown: std::collections::HashSet<Arc<str>> = std::collections::HashSet::new();
    let mut md_changes = md.changes();
    // Only the gauges are refreshed on a timer; subscriptions follow the pool and the metadata.
    let mut gauges = tokio::time::interval(GAUGES_EVERY);
    gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let endpoints = pool.borrow_and_update().clone();
        md_changes.borrow_and_update();
        // Departed endpoints' subscriptions stop (their routing state is forgotten by the
        // router's upkeep).
        subs.retain(|addr, _| endpoints.iter().any(|e| e.addr_str == *addr));
        shown.retain(|addr| {
            let keep = endpoints.iter().any(|e| e.addr_str == *addr);
            if !keep {
                metrics.fallback.remove(&EndpointLabels {
                    endpoint: addr.clone(),
                });
            }
            keep
        });
        for ep in endpoints.iter() {
            let sources = sources_of(ep, md.get(&ep.addr).as_deref(), &cfg);
            if subs.get(&ep.addr_str).map(|r| &r.sources) == Some(&sources) {
                continue;
            }
            let stops = sources
                .iter()
                .map(|(rank, source)| {
                    let (stop_tx, stop_rx) = watch::channel(false);
                    tokio::spawn(subscription(
                        kv.clone(),
                        Target {
                            worker: ep.worker,
                            endpoint: ep.addr_str.clone(),
                            rank: *rank,
                            // An endpoint that is one rank: its publisher's events are that
                            // rank's, whatever rank its batches carry.
                            pinned: ep.dp_rank.is_some(),
                        },
                        source.clone(),
                        metrics.clone(),
                        stop_rx,
                    ));
                    stop_tx
                })
                .collect();
            subs.insert(ep.addr_str.clone(), Running { sources, stops });
        }
        loop {
            metrics
                .subscriptions
                .set(subs.values().map(|r| r.stops.len() as i64).sum());
            metrics.block_size.set(i64::from(kv.block_size()));
            for ep in endpoints.iter() {
                let labels = EndpointLabels {
                    endpoint: ep.addr_str.clone(),
                };
                let on = kv.in_events_fallback(ep.worker);
                if on || shown.contains(&ep.addr_str) {
                    shown.insert(ep.addr_str.clone());
                    metrics.fallback.get_or_create(&labels).set(i64::from(on));
                }
            }
            {
                let index = kv.index().read();
                metrics.index_blocks.set(index.block_count() as i64);
                metrics.index_pairs.set(index.pair_count() as i64);
                metrics.index_memory_bytes.set(index.memory_bytes() as i64);
                crate::metrics::catch_up(&metrics.index_evicted, index.stats().evicted);
            }
            tokio::select! {
                r = pool.changed() => if r.is_err() { return } else { break },
                r = md_changes.changed() => if r.is_err() { return } else { break },
                _ = gauges.tick() => {}
                _ = shutdown.changed() => if *shutdown.borrow() { return },
            }
        }
    }
}

/// How often the index gauges are refreshed.
const GAUGES_EVERY: Duration = Duration::from_secs(1);

/// One KV-event subscription a registered worker rank asks for (the selection service's
/// catalog): into `kv`'s index, as `worker`'s rank `rank`.
#[derive(Debug, Clone)]
pub struct Subscribe {
    pub kv: Arc<KvState>,
    pub worker: u64,
    pub rank: u32,
    /// Names the subscription in logs and metrics.
    pub label: Arc<str>,
    pub source: Source,
}

impl Subscribe {
    fn same_as(&self, o: &Subscribe) -> bool {
        Arc::ptr_eq(&self.kv, &o.kv)
            && (self.worker, self.rank, &self.source) == (o.worker, o.rank, &o.source)
    }
}

/// Keeps exactly the subscriptions of the latest set: new ones start, changed ones restart,
/// missing ones stop (their blocks leave with their worker through the catalog).
pub(crate) async fn run_registered(
    mut set: watch::Receiver<Vec<Subscribe>>,
    metrics: Arc<KvEventMetrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut running: Vec<(Subscribe, watch::Sender<bool>)> = Vec::new();
    loop {
        let wanted = set.borrow_and_update().clone();
        // Dropping a stop sender ends its subscription.
        running.retain(|(r, stop)| {
            let keep = wanted.iter().any(|w| w.same_as(r));
            if !keep {
                let _ = stop.send(true);
            }
            keep
        });
        for w in wanted {
            if running.iter().any(|(r, _)| r.same_as(&w)) {
                continue;
            }
            let (stop_tx, stop_rx) = watch::channel(false);
            tokio::spawn(subscription(
                w.kv.clone(),
                Target {
                    worker: w.worker,
                    endpoint: w.label.clone(),
                    rank: w.rank,
                    pinned: false,
                },
                w.source.clone(),
                metrics.clone(),
                stop_rx,
            ));
            running.push((w, stop_tx));
        }
        metrics.subscriptions.set(running.len() as i64);
        tokio::select! {
            r = set.changed() => if r.is_err() { break },
            _ = shutdown.changed() => if *shutdown.borrow() { break },
        }
    }
    for (_, stop) in running {
        let _ = stop.send(true);
    }
}

/// Whose events a subscription delivers: the worker, its metric label, and the rank (`pinned`:
/// every batch is that rank's, whatever rank it carries).
struct Target {
    worker: u64,
    endpoint: Arc<str>,
    rank: u32,
    pinned: bool,
}

/// Batches queued in the index (by any subscription) at which a subscription publishes them,
/// whatever else it has at hand.
const MAX_QUEUED_BATCHES: usize = 64;

/// What one rank's subscription applies its deliveries to, and what it remembers of them.
struct Applier {
    kv: Arc<KvState>,
    worker: u64,
    rank: u32,
    /// The endpoint is one rank: its publisher's events are that rank's, whatever they carry.
    pin_rank: bool,
    labels: EndpointLabels,
    metrics: Arc<KvEventMetrics>,
    /// Whether anything was delivered yet: a loss before that is the gap the subscription opened
    /// with, not a removal missed after blocks it delivered.
    delivered: bool,
    /// The last batch did not decode: the endpoint is matched approximately.
    fallback: bool,
    /// The ranks this publisher has published for: what a restart or a loss makes void.
    ranks: std::collections::BTreeSet<u32>,
}

impl Applier {
    /// Drops every block of the ranks this publisher published for.
    fn forget(&self) {
        let worker = self.worker;
        self.kv.index().write(|index| {
            for &dp_rank in &self.ranks {
                index.clear_rank(WorkerRank { worker, dp_rank });
            }
        });
    }

    fn apply(&mut self, d: Delivery) {
        match d {
            Delivery::Batch {
                batch, received, ..
            } => self.batch(batch, received),
            Delivery::PublisherRestarted => {
                self.delivered = true;
                self.metrics.publisher_restarts.inc();
                self.forget();
            }
            Delivery::Lost { from, to } if !self.delivered => {
                tracing::info!(endpoint = %self.labels.endpoint, from, to, "joined a publisher past its first batches; the rank's recovered blocks are kept");
            }
            Delivery::Lost { .. } => self.forget(),
            // What the batch changed is unknown: the endpoint's blocks are dropped (never mixed
            // with what follows) and it is matched approximately until a batch decodes.
            Delivery::Undecodable { seq } => {
                self.forget();
                if !self.fallback {
                    self.fallback = true;
                    self.kv.set_events_fallback(self.worker, true);
                    tracing::warn!(endpoint = %self.labels.endpoint, seq, "KV events do not decode: the endpoint's blocks are dropped and it is matched by what kvepp routes to it until they decode again");
                }
            }
        }
    }

    fn batch(&mut self, mut batch: EventBatch, received: Instant) {
        self.delivered = true;
        if self.fallback {
            self.fallback = false;
            self.kv.set_events_fallback(self.worker, false);
            tracing::info!(endpoint = %self.labels.endpoint, "KV events decode again: the endpoint is matched by its events, rebuilt from this batch on");
        }
        if self.pin_rank {
            batch.data_parallel_rank = None;
        }
        let (kv, worker, rank) = (&self.kv, self.worker, self.rank);
        self.ranks.insert(batch.data_parallel_rank.unwrap_or(rank));
        // A stored block states the engine's block size: learned from it as from the metrics
        // page, so what the engine published before kvepp's first scrape of it (the catch-up
        // replay) is not dropped as another size.
        if let Some(bs) = batch.events.iter().find_map(|e| match e {
            KvEvent::Stored { block_size, .. } => Some(*block_size),
            _ => None,
        }) {
            kv.learn_block_size(worker, bs);
        }
        let block_size = kv.block_size();
        let (metrics, labels) = (self.metrics.clone(), self.labels.clone());
        // Queued, and published with whatever else is queued once the subscription has nothing
        // more at hand, or by another subscription's publication in the meantime; neither waits
        // for the readers of the other copy, which gets the batch at the next publication.
        kv.index().enqueue(
            move |index| apply_batch(index, worker, rank, block_size, &batch),
            move |applied: Applied| {
                metrics.observe_applied(&labels, &applied, received);
            },
        );
    }

    /// The subscription ends: an endpoint in fallback for its events leaves it.
    fn end(self) {
        self.kv.index().flush();
        if self.fallback {
            self.kv.set_events_fallback(self.worker, false);
        }
    }
}

/// One rank's subscription: deliveries into the index, subscriber counters into metrics.
async fn subscription(
    kv: Arc<KvState>,
    target: Target,
    source: Source,
    metrics: Arc<KvEventMetrics>,
    stop: watch::Receiver<bool>,
) {
    let Target {
        worker,
        endpoint,
        rank,
        pinned: pin_rank,
    } = target;
    tracing::info!(endpoint = %endpoint, dp_rank = rank, events = %source.endpoint, "subscribing to KV events");
    let (tx, mut rx) = mpsc::channel(64);
    let stats = Arc::new(SubscriberStats::default());
    let task = tokio::spawn(subscriber::run(
        source,
        tx,
        stats.clone(),
        Timing::default(),
        stop,
    ));
    let mut applier = Applier {
        kv: kv.clone(),
        worker,
        rank,
        pin_rank,
        labels: EndpointLabels { endpoint },
        metrics: metrics.clone(),
        delivered: false,
        fallback: false,
        ranks: std::collections::BTreeSet::from([rank]),
    };
    let (mut seen_undecodable, mut seen_lost) = (0, 0);
    let mut counted_without_replay = false;
    // The tick only refreshes the undecodable counter while nothing decodable arrives.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let delivery = tokio::select! {
            d = rx.recv() => match d {
                Some(d) => Some(d),
                None => break,
            },
            _ = tick.tick() => None,
        };
        if let Some(d) = delivery {
            applier.apply(d);
        }
        // Publish once nothing more is at hand, or once the index holds a bounded number of
        // queued batches (a publisher that never pauses must not keep its batches from picks).
        if rx.is_empty() || kv.index().queued() >= MAX_QUEUED_BATCHES {
            kv.index().flush();
        }
        let undecodable = stats.undecodable.load(Ordering::Relaxed);
        metrics.undecodable.inc_by(undecodable - seen_undecodable);
        seen_undecodable = undecodable;
        let lost = stats.lost.load(Ordering::Relaxed);
        metrics.lost_batches.inc_by(lost - seen_lost);
        seen_lost = lost;
        if !counted_without_replay && stats.without_replay.load(Ordering::Relaxed) > 0 {
            counted_without_replay = true;
            metrics.without_replay.inc();
        }
    }
    applier.end();
    let _ = task.await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(addr: &str) -> Endpoint {
        Endpoint::new(addr.parse().expect("addr"), "pod")
    }

    #[test]
    fn configured_sources_per_address_family_and_metadata_first() {
        let cfg = KvEventsConfig {
            enabled: true,
            port: 5557,
            replay_port: Some(5558),
            topic: "kv".into(),
            ..KvEventsConfig::default()
        };
        let v6 = sources_of(&endpoint("[fd00::1]:8000"), None, &cfg);
        assert_eq!(v6[0].1.endpoint, "tcp://[fd00::1]:5557");
        assert_eq!(
            v6[0].1.replay_endpoint.as_deref(),
            Some("tcp://[fd00::1]:5558")
        );
        let v4 = sources_of(&endpoint("10.0.0.7:8000"), None, &cfg);
        assert_eq!(
            (v4[0].0, v4[0].1.endpoint.as_str()),
            (0, "tcp://10.0.0.7:5557")
        );
        let md =
            EngineMetadata::parse(br#"{"kv_events": {"endpoints": {"1": "tcp://10.0.0.7:6001"}}}"#)
                .expect("metadata");
        let from_md = sources_of(&endpoint("10.0.0.7:8000"), Some(&md), &cfg);
        assert_eq!(
            (from_md[0].0, from_md[0].1.endpoint.as_str()),
            (1, "tcp://10.0.0.7:6001")
        );
        let off = KvEventsConfig {
            enabled: false,
            ..cfg
        };
        assert!(sources_of(&endpoint("10.0.0.7:8000"), None, &off).is_empty());
    }

    #[test]
    fn a_rank_endpoint_takes_only_its_own_publisher() {
        let cfg = KvEventsConfig {
            enabled: true,
            port: 5557,
            replay_port: Some(5600),
            topic: String::new(),
            ..KvEventsConfig::default()
        };
        let mut rank1 = endpoint("10.0.0.7:8001");
        rank1.dp_rank = Some(1);
        let own = sources_of(&rank1, None, &cfg);
        assert_eq!(own.len(), 1);
        assert_eq!(
            (own[0].0, own[0].1.endpoint.as_str()),
            (1, "tcp://10.0.0.7:5558")
        );
        assert_eq!(
            own[0].1.replay_endpoint.as_deref(),
            Some("tcp://10.0.0.7:5601")
        );
        let md = EngineMetadata::parse(
            br#"{"kv_events": {"endpoints": {"0": "tcp://10.0.0.7:6000", "1": "tcp://10.0.0.7:6001"}}}"#,
        )
        .expect("metadata");
        let from_md = sources_of(&rank1, Some(&md), &cfg);
        assert_eq!(from_md.len(), 1);
        assert_eq!(
            (from_md[0].0, from_md[0].1.endpoint.as_str()),
            (1, "tcp://10.0.0.7:6001")
        );
        // A one-port endpoint of a data-parallel engine still takes every rank.
        assert_eq!(
            sources_of(&endpoint("10.0.0.7:8000"), Some(&md), &cfg).len(),
            2
        );
    }
}
