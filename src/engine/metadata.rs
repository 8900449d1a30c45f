//! Per-endpoint metadata (what `Instance.metadata()` returns): when an endpoint's EndpointSlice lists a
//! port named `metadata`, the engine's worker agent serves `GET /metadata` there:
//!
//! ```json
//! {"model": {"name": "m", "type": "Completions",
//!            "runtime_config": {"block_size": 16, "total_kv_blocks": 24064, "max_num_seqs": 256,
//!                               "max_num_batched_tokens": 2048, "data_parallel_size": 1}},
//!  "kv_events": {"endpoints": {"0": "tcp://10.1.2.3:5557"},
//!                "replay_endpoints": {"0": "tcp://10.1.2.3:5558"}},
//!  "topology_domains": {"zone": "us-east-1a"},
//!  "role": "both",
//!  "lora_adapters": ["sql-lora"], "max_loras": 4}
//! ```
//!
//! `lora_adapters` (the LoRA adapters the engine serves, e.g. its `--lora-modules`) and `max_loras`
//! (its GPU adapter slots) stand for the engine's adapters until its `vllm:lora_requests_info`
//! says which are loaded.
//!
//! Every field is optional and unknown fields are ignored. [`run_fetcher`] fetches it when an
//! endpoint appears (or its metadata port changes), retries failures with exponential backoff, and
//! refreshes it periodically; [`MetadataStore`] holds the latest per endpoint.

use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use kvepp_core::{Endpoint, Role};

use super::FetchError;
use crate::metrics::EndpointLabels;

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct EngineMetadata {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<ModelInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<KvEventsInfo>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub topology_domains: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lora_adapters: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_loras: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct ModelInfo {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[serde(rename = "type")]
    pub kind: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub runtime_config: Option<RuntimeConfig>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct RuntimeConfig {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub total_kv_blocks: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_batched_tokens: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default)]
pub struct KvEventsInfo {
    /// Data-parallel rank (as a string key) → publisher endpoint.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub endpoints: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub replay_endpoints: BTreeMap<String, String>,
}

impl EngineMetadata {
    /// The KV blocks the engine has room for (`model.runtime_config.total_kv_blocks`).
    pub(crate) fn total_kv_blocks(&self) -> Option<u64> {
        self.model
            .as_ref()?
            .runtime_config
            .as_ref()?
            .total_kv_blocks
            .filter(|&n| n > 0)
    }

    pub(crate) fn parse(body: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(body)
    }

    pub(crate) fn block_size(&self) -> Option<u32> {
        self.model.as_ref()?.runtime_config.as_ref()?.block_size
    }

    pub(crate) fn model_name(&self) -> Option<&str> {
        self.model.as_ref()?.name.as_deref()
    }

    /// The adapters the document lists (None: it lists none).
    pub(crate) fn adapters(&self) -> Option<kvepp_core::affinity::AdapterSlots> {
        (!self.lora_adapters.is_empty()).then(|| kvepp_core::affinity::AdapterSlots {
            running: self
                .lora_adapters
                .iter()
                .map(|a| a.as_str().into())
                .collect(),
            waiting: Vec::new(),
            max_lora: self.max_loras.unwrap_or(0),
            from_metadata: true,
        })
    }

    /// The endpoint's role (an unknown value counts as `both`, with a warning).
    pub(crate) fn role_kind(&self) -> Role {
        match self.role.as_deref() {
            None => Role::Both,
            Some(r) => Role::parse(r).unwrap_or_else(|| {
                tracing::warn!(
                    role = r,
                    "unknown role in /metadata (expected prefill, decode or both); treated as both"
                );
                Role::Both
            }),
        }
    }

    /// (rank, publisher, replay) for every rank with a valid number; others are skipped.
    pub(crate) fn kv_event_sources(&self) -> Vec<(u32, String, Option<String>)> {
        let Some(kv) = &self.kv_events else {
            return Vec::new();
        };
        kv.endpoints
            .iter()
            .filter_map(|(rank, ep)| {
                let r = rank.parse::<u32>().ok()?;
                Some((r, ep.clone(), kv.replay_endpoints.get(rank).cloned()))
            })
            .collect()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum FetchMetadataError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error("/metadata of {addr}: {source}")]
    Parse {
        addr: SocketAddr,
        source: serde_json::Error,
    },
}

/// Largest `/metadata` document read.
pub(crate) const MAX_METADATA_BYTES: usize = 1 << 20;

/// `GET http://addr/metadata`, parsed (at most [`MAX_METADATA_BYTES`]).
pub(crate) async fn fetch_metadata(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<EngineMetadata, FetchMetadataError> {
    let body = super::get(addr, "/metadata", timeout, MAX_METADATA_BYTES).await?;
    EngineMetadata::parse(&body).map_err(|source| FetchMetadataError::Parse { addr, source })
}

/// The latest metadata of every endpoint that serves it.
#[derive(Debug)]
pub struct MetadataStore {
    map: Mutex<HashMap<SocketAddr, Arc<EngineMetadata>>>,
    /// Bumped on every change (the KV-event manager re-reads its sources then).
    version: watch::Sender<u64>,
}

impl Default for MetadataStore {
    fn default() -> Self {
        MetadataStore {
            map: Mutex::default(),
            version: watch::channel(0).0,
        }
    }
}

impl MetadataStore {
    /// Changes as they happen (the value is a change counter).
    pub(crate) fn changes(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }

    fn changed(&self) {
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub(crate) fn get(&self, addr: &SocketAddr) -> Option<Arc<EngineMetadata>> {
        self.lock().get(addr).cloned()
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, HashMap<SocketAddr, Arc<EngineMetadata>>> {
        self.map.lock()
    }

    /// Stores `md`; false when it equals what was there.
    fn set(&self, addr: SocketAddr, md: EngineMetadata) -> bool {
        let mut map = self.lock();
        if map.get(&addr).is_some_and(|old| **old == md) {
            return false;
        }
        map.insert(addr, Arc::new(md));
        drop(map);
        self.changed();
        true
    }

    fn remove(&self, addr: &SocketAddr) {
        if self.lock().remove(addr).is_some() {
            self.changed();
        }
    }
}

/// Fetching each endpoint's `/metadata` (config section `engine_metadata`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct FetchSettings {
    /// Re-fetch a document this long after a success, in milliseconds.
    pub refresh_ms: u64,
    /// Time allowed for one fetch, in milliseconds.
    pub timeout_ms: u64,
    /// First retry delay after a failure (doubling up to `backoff_max_ms`), in milliseconds.
    pub backoff_min_ms: u64,
    /// Longest retry delay after failures, in milliseconds.
    pub backoff_max_ms: u64,
}

impl Default for FetchSettings {
    fn default() -> Self {
        FetchSettings {
            refresh_ms: 30_000,
            timeout_ms: 2_000,
            backoff_min_ms: 250,
            backoff_max_ms: 30_000,
        }
    }
}

impl FetchSettings {
    fn refresh(&self) -> Duration {
        Duration::from_millis(self.refresh_ms)
    }
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
    fn backoff_min(&self) -> Duration {
        Duration::from_millis(self.backoff_min_ms)
    }
    fn backoff_max(&self) -> Duration {
        Duration::from_millis(self.backoff_max_ms.max(self.backoff_min_ms))
    }
}

struct Due {
    port: u16,
    at: Instant,
    backoff: Duration,
    warned: bool,
}

/// Keeps `md` up to date for every ready endpoint with a `metadata` port, woken by pool changes
/// (`pool`) and by the next due fetch, never by polling; `on_update` sees each new or changed
/// document, and `None` when an endpoint's document is dropped (it left, or lost its port). An endpoint whose document cannot be fetched stays routable with defaults
/// and is marked in `missing` (1) until a fetch succeeds.
pub(crate) async fn run_fetcher(
    mut pool: watch::Receiver<Arc<[Arc<Endpoint>]>>,
    md: Arc<MetadataStore>,
    settings: FetchSettings,
    on_update: impl Fn(SocketAddr, Option<&EngineMetadata>) + Send + Sync + 'static,
    missing: Family<EndpointLabels, Gauge>,
    mut shutdown: watch::Receiver<bool>,
) {
    let label = |addr: &SocketAddr| EndpointLabels {
        endpoint: addr.to_string().into(),
    };
    let mut due: HashMap<SocketAddr, Due> = HashMap::new();
    loop {
        let now = Instant::now();
        let endpoints = pool.borrow_and_update().clone();
        let wanted: HashMap<SocketAddr, u16> = endpoints
            .iter()
            .filter_map(|e| Some((e.addr, e.metadata_port?)))
            .collect();
        due.retain(|addr, d| {
            let keep = wanted.get(addr) == Some(&d.port);
            if !keep {
                md.remove(addr);
                missing.remove(&label(addr));
                on_update(*addr, None);
            }
            keep
        });
        for (&addr, &port) in &wanted {
            due.entry(addr).or_insert(Due {
                port,
                at: now,
                backoff: settings.backoff_min(),
                warned: false,
            });
        }
        let mut fetches = tokio::task::JoinSet::new();
        for (&addr, d) in due.iter().filter(|(_, d)| d.at <= now) {
            let target = SocketAddr::new(addr.ip(), d.port);
            fetches.spawn(async move {
                let r = fetch_metadata(target, settings.timeout())
                    .await
                    .map_err(|e| e.to_string());
                (addr, r)
            });
        }
        while let Some(done) = fetches.join_next().await {
            let Ok((addr, result)) = done else { continue };
            let Some(d) = due.get_mut(&addr) else {
                continue;
            };
            let now = Instant::now();
            match result {
                Ok(doc) => {
                    missing.get_or_create(&label(&addr)).set(0);
                    d.at = now + settings.refresh();
                    d.backoff = settings.backoff_min();
                    d.warned = false;
                    if md.set(addr, doc.clone()) {
                        tracing::info!(endpoint = %addr, model = doc.model_name(), block_size = doc.block_size(),
                            kv_event_ranks = doc.kv_event_sources().len(), "engine metadata updated");
                        on_update(addr, Some(&doc));
                    }
                }
                Err(e) => {
                    missing.get_or_create(&label(&addr)).set(1);
                    if !d.warned {
                        tracing::warn!(endpoint = %addr, error = %e, retry_in = ?d.backoff, "engine metadata fetch failed");
                        d.warned = true;
                    }
                    d.at = now + d.backoff;
                    d.backoff = (d.backoff * 2).min(settings.backoff_max());
                }
            }
        }
        // Sleep until the next fetch is due or the pool changes.
        let next = due.values().map(|d| d.at).min();
        let sleep = async {
            match next {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sleep => {}
            r = pool.changed() => if r.is_err() { return },
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_document_and_defaults() {
        let doc = br#"{"model": {"name": "m", "type": "Completions",
            "runtime_config": {"block_size": 16, "total_kv_blocks": 24064, "max_num_seqs": 256,
                               "max_num_batched_tokens": 2048, "data_parallel_size": 2, "new": 1}},
          "kv_events": {"endpoints": {"0": "tcp://10.1.2.3:5557", "1": "tcp://10.1.2.3:5558", "x": "tcp://bad"},
                        "replay_endpoints": {"0": "tcp://10.1.2.3:5560"}},
          "topology_domains": {"zone": "us-east-1a"},
          "role": "both", "unknown": {"a": [1]}}"#;
        let md = EngineMetadata::parse(doc).unwrap();
        assert_eq!(md.block_size(), Some(16));
        assert_eq!(md.model_name(), Some("m"));
        assert_eq!(md.role.as_deref(), Some("both"));
        assert_eq!(md.topology_domains["zone"], "us-east-1a");
        assert_eq!(
            md.kv_event_sources(),
            vec![
                (
                    0,
                    "tcp://10.1.2.3:5557".into(),
                    Some("tcp://10.1.2.3:5560".into())
                ),
                (1, "tcp://10.1.2.3:5558".into(), None),
            ]
        );
        assert_eq!(md.adapters(), None, "no adapters listed");
        let with = EngineMetadata::parse(br#"{"lora_adapters": ["sql", "chat"], "max_loras": 4}"#)
            .unwrap()
            .adapters()
            .unwrap();
        assert_eq!(
            (with.running.len(), with.max_lora, with.from_metadata),
            (2, 4, true)
        );
        let empty = EngineMetadata::parse(b"{}").unwrap();
        assert_eq!(empty, EngineMetadata::default());
        assert!(empty.kv_event_sources().is_empty());
        assert!(EngineMetadata::parse(b"[1]").is_err());
        assert!(
            EngineMetadata::parse(br#"{"model": {"runtime_config": {"block_size": -1}}}"#).is_err()
        );
    }

    #[test]
    fn store_reports_changes_only() {
        let s = MetadataStore::default();
        let a: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert!(s.set(a, EngineMetadata::default()));
        assert!(!s.set(a, EngineMetadata::default()));
        assert_eq!(s.get(&a).as_deref(), Some(&EngineMetadata::default()));
        s.remove(&a);
        assert_eq!(s.get(&a), None);
        assert!(
            s.set(a, EngineMetadata::default()),
            "new again after removal"
        );
    }
}
