//! Index recovery: `GET /dump` answers a snapshot of the KV-event index per (model, tenant) from
//! which a peer rebuilds an equal index; on start, the `--indexer-peers` are asked in turn and the
//! first good dump of a ready peer (`/ready` answered 200 within two seconds) is applied before the
//! service answers.
//!
//! Format (`kvepp-index-dump/1`): `{"format", "scopes": [{"model_name", "tenant_id",
//! "block_size", "ranks": [{"worker_id", "dp_rank", "blocks": [[sequence_hash, device, host,
//! disk], ...], "engine": [[engine_hash, sequence_hash], ...]}]}]}`: every block a rank holds with
//! its reference count per tier, and the engine's own hash of blocks it names differently (for
//! later removals). Hashes are unsigned 64-bit JSON integers. Each scope may also carry
//! `"sessions": [[session_key, worker_id, dp_rank, idle_ms], ...]`: its router's live session
//! bindings and the time since each was last used (absent in dumps of older builds: none).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use kvepp_core::affinity::{SessionKey, Sessions};
use kvepp_core::catalog::{Catalog, Scope};
use kvepp_core::index::{EngineBlockHash, RankDump};
use kvepp_core::slots::WorkerRank;
use kvepp_core::{KvState, SequenceHash};

pub(crate) const FORMAT: &str = "kvepp-index-dump/1";

/// What the start's recovery did: `kvepp_index_recoveries_total{result}` (`recovered`: a peer's
/// dump applied; `failed`: no peer usable, the replica started with an empty index) and
/// `kvepp_index_recovered_pairs` (the pairs the applied dump restored).
#[derive(Debug, Clone, Default)]
pub struct RecoveryMetrics {
    pub recoveries: prometheus_client::metrics::family::Family<
        crate::metrics::ResultLabels,
        prometheus_client::metrics::counter::Counter,
    >,
    pub pairs: prometheus_client::metrics::gauge::Gauge,
}

impl RecoveryMetrics {
    /// Records one recovery's outcome.
    pub(crate) fn observe(&self, outcome: &Result<(String, u64), RecoveryError>) {
        let result = match outcome {
            Ok((_, pairs)) => {
                self.pairs.set(i64::try_from(*pairs).unwrap_or(i64::MAX));
                "recovered"
            }
            Err(_) => "failed",
        };
        self.recoveries
            .get_or_create(&crate::metrics::ResultLabels { result })
            .inc();
    }
}

impl crate::metrics::Register for RecoveryMetrics {
    fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "index_recoveries",
            "KV-index recoveries from an indexer peer's /dump at start, by result: recovered, failed (no peer usable: started with an empty index)",
            self.recoveries.clone(),
        );
        registry.register(
            "index_recovered_pairs",
            "Pairs (block, rank) the last recovery from a peer's /dump restored",
            self.pairs.clone(),
        );
    }
}

/// Largest dump accepted from a peer.
pub(crate) const MAX_DUMP_BYTES: usize = 256 << 20;

const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a peer has to answer `/ready` before the dump is asked for: a peer that is itself
/// starting (its HTTP port bound, not yet served) or not ready is skipped at once instead of
/// holding this start for [`FETCH_TIMEOUT`].
const READY_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DumpDoc {
    pub format: String,
    pub scopes: Vec<ScopeDump>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopeDump {
    pub model_name: String,
    pub tenant_id: String,
    pub block_size: u32,
    pub ranks: Vec<RankJson>,
    /// Session bindings: (session key, worker id, dp rank, ms since last use).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sessions: Vec<(u64, u64, u32, u64)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankJson {
    pub worker_id: u64,
    pub dp_rank: u32,
    pub blocks: Vec<(u64, u16, u16, u16)>,
    #[serde(default)]
    pub engine: Vec<(u64, u64)>,
}

fn to_json(d: RankDump) -> RankJson {
    RankJson {
        worker_id: d.rank.worker,
        dp_rank: d.rank.dp_rank,
        blocks: d
            .blocks
            .into_iter()
            .map(|(h, [a, b, c])| (h.0, a, b, c))
            .collect(),
        engine: d.engine.into_iter().map(|(e, s)| (e.0, s.0)).collect(),
    }
}

fn from_json(r: RankJson) -> RankDump {
    RankDump {
        rank: WorkerRank {
            worker: r.worker_id,
            dp_rank: r.dp_rank,
        },
        blocks: r
            .blocks
            .into_iter()
            .map(|(h, a, b, c)| (SequenceHash(h), [a, b, c]))
            .collect(),
        engine: r
            .engine
            .into_iter()
            .map(|(e, s)| (EngineBlockHash(e), SequenceHash(s)))
            .collect(),
    }
}

/// One scope's snapshot: its index, and the session bindings of its router when given.
pub(crate) fn scope_dump(scope: &Scope, kv: &KvState, sessions: Option<&Sessions>) -> ScopeDump {
    let dumps = kv.index().read().dump();
    let now = kvepp_core::types::clock_nanos(std::time::Instant::now());
    ScopeDump {
        model_name: scope.model.clone(),
        tenant_id: scope.tenant.clone(),
        block_size: kv.block_size(),
        ranks: dumps.into_iter().map(to_json).collect(),
        sessions: sessions.map_or_else(Vec::new, |s| {
            s.dump(now)
                .into_iter()
                .map(|(k, r, idle)| {
                    let ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
                    (k.0, r.worker, r.dp_rank, ms)
                })
                .collect()
        }),
    }
}

/// A dump's session bindings applied to `router` (as a peer's: not published again). Returns
/// how many.
pub(crate) fn restore_sessions(
    router: &kvepp_core::Router,
    sessions: &[(u64, u64, u32, u64)],
) -> u64 {
    let now = std::time::Instant::now();
    for &(key, worker, dp_rank, idle_ms) in sessions {
        router.bind_peer_session(
            SessionKey(key),
            WorkerRank { worker, dp_rank },
            now,
            Duration::from_millis(idle_ms),
        );
    }
    sessions.len() as u64
}

/// The snapshot of every scope of `catalog` (pooled: one, under `pool_scope`).
pub(crate) fn dump(catalog: &Catalog, pool_scope: &Scope) -> DumpDoc {
    DumpDoc {
        format: FORMAT.into(),
        scopes: catalog
            .trackers(pool_scope)
            .map(|(s, t)| scope_dump(s, &t.kv, Some(t.router().sessions())))
            .collect(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    #[error("{url}: {message}")]
    Peer { url: String, message: String },
    #[error("no indexer peer gave a usable dump: {0}")]
    NonePeer(String),
}

/// `GET <url>/dump`, parsed.
pub(crate) async fn fetch(url: &str) -> Result<DumpDoc, RecoveryError> {
    let err = |message: String| RecoveryError::Peer {
        url: url.to_owned(),
        message,
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| err("only http:// peers are supported".into()))?;
    let (authority, base) = match rest.split_once('/') {
        Some((a, p)) => (a, format!("/{}", p.trim_end_matches('/'))),
        None => (rest, String::new()),
    };
    let authority = if authority.contains(':') {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let addr = tokio::net::lookup_host(&authority)
        .await
        .map_err(|e| err(e.to_string()))?
        .next()
        .ok_or_else(|| err("no address".into()))?;
    crate::engine::get(addr, &format!("{base}/ready"), READY_TIMEOUT, 4096)
        .await
        .map_err(|e| err(format!("not ready: {e}")))?;
    let body = crate::engine::get(addr, &format!("{base}/dump"), FETCH_TIMEOUT, MAX_DUMP_BYTES)
        .await
        .map_err(|e| err(e.to_string()))?;
    let doc: DumpDoc = serde_json::from_slice(&body).map_err(|e| err(e.to_string()))?;
    if doc.format != FORMAT {
        return Err(err(format!("dump format {:?}, not {FORMAT}", doc.format)));
    }
    Ok(doc)
}

/// Asks `peers` in turn and applies the first good dump with `apply` (the pairs restored at once);
/// returns the peer used and that count.
async fn first_good(
    peers: &[String],
    mut apply: impl FnMut(DumpDoc) -> Result<u64, String>,
) -> Result<(String, u64), RecoveryError> {
    let mut errors = Vec::new();
    for url in peers {
        let outcome = match fetch(url).await {
            Ok(doc) => apply(doc).map_err(|message| RecoveryError::Peer {
                url: url.clone(),
                message,
            }),
            Err(e) => Err(e),
        };
        match outcome {
            Ok(restored) => {
                tracing::info!(peer = %url, restored, "KV index recovered from a peer's dump");
                return Ok((url.clone(), restored));
            }
            Err(e) => {
                tracing::warn!(error = %e, "indexer peer unusable; trying the next");
                errors.push(e.to_string());
            }
        }
    }
    Err(RecoveryError::NonePeer(errors.join("; ")))
}

/// Asks `peers` in turn; applies the first good dump to `catalog`. Returns the peer used and the
/// pairs restored at once (scopes without workers yet are applied when their first worker
/// registers).
pub(crate) async fn recover(
    catalog: &parking_lot::RwLock<Catalog>,
    peers: &[String],
) -> Result<(String, u64), RecoveryError> {
    first_good(peers, |doc| {
        let mut c = catalog.write();
        let mut restored = 0;
        for s in doc.scopes {
            let scope = Scope {
                model: s.model_name,
                tenant: s.tenant_id,
            };
            let dumps = s.ranks.into_iter().map(from_json).collect();
            if let Ok(t) = c.tracker(&scope) {
                restore_sessions(t.router(), &s.sessions);
            }
            restored += c
                .recover(scope, s.block_size, dumps)
                .map_err(|e| e.to_string())?;
        }
        Ok(restored)
    })
    .await
}

/// `kvepp serve`: asks `peers` in turn and restores the first good dump's content into the
/// picker's index (every scope with the same block size: a replica has one) and its sessions into
/// `router`.
pub(crate) async fn recover_pool(
    kv: &KvState,
    router: &kvepp_core::Router,
    peers: &[String],
) -> Result<(String, u64), RecoveryError> {
    first_good(peers, |doc| {
        let scopes: Vec<ScopeDump> = doc
            .scopes
            .into_iter()
            .filter(|s| s.block_size == kv.block_size())
            .collect();
        let sessions: u64 = scopes
            .iter()
            .map(|s| restore_sessions(router, &s.sessions))
            .sum();
        if sessions > 0 {
            tracing::info!(sessions, "session bindings recovered from a peer's dump");
        }
        let dumps: Vec<Vec<RankDump>> = scopes
            .into_iter()
            .map(|s| s.ranks.into_iter().map(from_json).collect())
            .collect();
        kv.index().write(|index| {
            let mut restored = 0;
            for d in &dumps {
                restored += index.restore(d).map_err(|e| e.to_string())?;
            }
            Ok(restored)
        })
    })
    .await
}
