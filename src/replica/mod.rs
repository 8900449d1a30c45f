//! Replica sync: kvepp processes share request lifecycle events (admission, prefill complete, free)
//! over ZMQ PUB/SUB so each one's load accounting sees the others' bookings. Output blocks stay
//! local (too frequent to broadcast).
//!
//! Owns: the wire messages (`proto/kvepp/replica/v1/replica.proto`, compiled by `build.rs`), the
//! [`Outbox`] the request path publishes through, the PUB task, one SUB task per peer, and
//! applying received events through a [`Sink`].
//!
//! Invariants: the request path never waits on the network: [`Outbox`] puts events on a bounded
//! queue and drops (and counts) them when it is full; a process ignores its own events (random
//! identity drawn at start); an event of another wire version, for an unknown (model, tenant),
//! worker, rank or block size, or a duplicate admission, is dropped and counted, never creates
//! anything; peers follow the peer list as it changes (a removed peer's SUB task stops). Best
//! effort, by design: no acknowledgement, replay or ordering.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use prost::Message;
use tokio::sync::{mpsc, watch};
use zeromq::{PubSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use crate::metrics::OutcomeLabels;
use kvepp_core::affinity::SessionKey;
use kvepp_core::catalog::Scope;
use kvepp_core::slots::WorkerRank;
use kvepp_core::{LocalBlockHash, SequenceHash};

pub(crate) mod observer;
pub mod peers;
pub(crate) mod recovery;
pub mod sink;

/// Generated from `proto/kvepp/replica/v1/replica.proto`.
#[allow(clippy::all, missing_docs)]
pub mod wire {
    include!(concat!(env!("OUT_DIR"), "/kvepp.replica.v1.rs"));
}

/// The wire version this build speaks.
pub const WIRE_VERSION: u32 = 1;

/// Events waiting for the PUB socket; beyond this the newest are dropped.
pub const QUEUE: usize = 8192;

/// Largest message accepted from a peer (a 128k-token prompt's admission is ~70 KB).
pub(crate) const MAX_MESSAGE_BYTES: usize = 1 << 20;

const RECONNECT_MIN: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// Events by outcome: `published`, `dropped_queue_full` (sending side); `received`, `applied`,
/// `dropped_own`, `dropped_version`, `dropped_undecodable`, `dropped_unknown`, `dropped_duplicate`
/// (receiving side). Registered in the process's metrics as `kvepp_replica_sync_events_total`.
#[derive(Debug, Default)]
pub struct SyncStats {
    pub events: Family<OutcomeLabels, Counter>,
}

impl crate::metrics::Register for SyncStats {
    fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "replica_sync_events",
            "Replica-sync lifecycle events by outcome (published, received, applied, dropped_*)",
            self.events.clone(),
        );
    }
}

impl SyncStats {
    fn count(&self, outcome: &'static str) {
        self.events.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// The count of one outcome.
    pub fn get(&self, outcome: &'static str) -> u64 {
        self.events.get_or_create(&OutcomeLabels { outcome }).get()
    }
}

/// Why a received event was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Unknown,
    Duplicate,
}

/// Applies peers' events to local state.
pub trait Sink: Send + Sync + 'static {
    fn admission(
        &self,
        scope: &Scope,
        request_id: &str,
        rank: WorkerRank,
        block_size: u32,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
    ) -> Result<(), Refused>;
    fn prefill_complete(&self, scope: &Scope, request_id: &str) -> Result<(), Refused>;
    fn free(&self, scope: &Scope, request_id: &str) -> Result<(), Refused>;
    /// A peer bound a client session to `rank`.
    fn session_bound(
        &self,
        scope: &Scope,
        key: SessionKey,
        rank: WorkerRank,
    ) -> Result<(), Refused>;
    /// Approximate prefix routing: a peer routed these blocks to `worker`.
    fn routed(
        &self,
        scope: &Scope,
        worker: u64,
        locals: Vec<LocalBlockHash>,
        hashes: Vec<SequenceHash>,
    ) -> Result<(), Refused>;
}

/// Where the request path publishes lifecycle events (cheap to clone; never blocks). A disabled
/// outbox (no replica sync configured) does nothing.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: Option<mpsc::Sender<Bytes>>,
    origin: u64,
    stats: Arc<SyncStats>,
}

impl Outbox {
    pub(crate) fn disabled() -> Self {
        Outbox {
            tx: None,
            origin: 0,
            stats: Arc::default(),
        }
    }

    /// Queues the event `event` builds (not built at all when replica sync is off).
    fn send(&self, scope: &Scope, event: impl FnOnce() -> wire::envelope::Event) {
        let Some(tx) = &self.tx else { return };
        let env = wire::Envelope {
            version: WIRE_VERSION,
            origin: self.origin,
            model_name: scope.model.clone(),
            tenant_id: scope.tenant.clone(),
            event: Some(event()),
        };
        match tx.try_send(Bytes::from(env.encode_to_vec())) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => self.stats.count("dropped_queue_full"),
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    pub(crate) fn admission(
        &self,
        scope: &Scope,
        request_id: &str,
        rank: WorkerRank,
        block_size: u32,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
    ) {
        self.send(scope, || {
            wire::envelope::Event::Admission(wire::Admission {
                request_id: request_id.to_owned(),
                worker_id: rank.worker,
                dp_rank: rank.dp_rank,
                block_size,
                sequence_hashes: hashes.iter().map(|h| h.0).collect(),
                prefill_tokens,
            })
        });
    }

    pub(crate) fn prefill_complete(&self, scope: &Scope, request_id: &str) {
        self.send(scope, || {
            wire::envelope::Event::PrefillComplete(wire::PrefillComplete {
                request_id: request_id.to_owned(),
            })
        });
    }

    /// Approximate prefix routing: `locals`/`hashes` were routed to `worker`.
    pub(crate) fn routed(
        &self,
        scope: &Scope,
        worker: u64,
        locals: &[LocalBlockHash],
        hashes: &[SequenceHash],
    ) {
        self.send(scope, || {
            wire::envelope::Event::Routed(wire::Routed {
                worker_id: worker,
                local_hashes: locals.iter().map(|h| h.0).collect(),
                sequence_hashes: hashes.iter().map(|h| h.0).collect(),
            })
        });
    }

    /// A client session was bound to `rank`.
    pub(crate) fn session_bound(&self, scope: &Scope, key: SessionKey, rank: WorkerRank) {
        self.send(scope, || {
            wire::envelope::Event::SessionBound(wire::SessionBound {
                session_key: key.0,
                worker_id: rank.worker,
                dp_rank: rank.dp_rank,
            })
        });
    }

    /// The random identity of this process on the wire (0 when disabled).
    pub(crate) fn origin(&self) -> u64 {
        self.origin
    }

    pub(crate) fn free(&self, scope: &Scope, request_id: &str) {
        self.send(scope, || {
            wire::envelope::Event::Free(wire::Free {
                request_id: request_id.to_owned(),
            })
        });
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("cannot bind the replica-sync PUB socket on {endpoint}: {message}")]
    Bind { endpoint: String, message: String },
}

/// ZMQ accepts `tcp://*:port` for "every interface"; the zeromq crate wants an address.
pub(crate) fn bindable(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// Binds the PUB socket and starts publishing; returns the outbox and the bound endpoint.
pub(crate) async fn start_publisher(
    bind: &str,
    stats: Arc<SyncStats>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<(Outbox, String), ReplicaError> {
    let mut socket = PubSocket::new();
    let bound = socket
        .bind(&bindable(bind))
        .await
        .map_err(|e| ReplicaError::Bind {
            endpoint: bind.to_owned(),
            message: e.to_string(),
        })?;
    let bound = bound.to_string();
    let (tx, mut rx) = mpsc::channel::<Bytes>(QUEUE);
    let origin = fastrand::u64(1..);
    tracing::info!(endpoint = %bound, origin = format!("{origin:016x}"), "replica sync publishing");
    let published = stats.clone();
    tokio::spawn(async move {
        loop {
            let payload = tokio::select! {
                p = rx.recv() => match p { Some(p) => p, None => return },
                _ = shutdown.changed() => if *shutdown.borrow() { return } else { continue },
            };
            if let Err(e) = socket.send(ZmqMessage::from(payload)).await {
                tracing::debug!(error = %e, "replica sync publish failed");
                continue;
            }
            published.count("published");
        }
    });
    Ok((
        Outbox {
            tx: Some(tx),
            origin,
            stats,
        },
        bound,
    ))
}

/// Decodes and applies one received message.
pub fn receive(payload: &[u8], origin: u64, sink: &dyn Sink, stats: &SyncStats) {
    stats.count("received");
    let env = match wire::Envelope::decode(payload) {
        Ok(e) if payload.len() <= MAX_MESSAGE_BYTES => e,
        _ => return stats.count("dropped_undecodable"),
    };
    if env.version != WIRE_VERSION {
        return stats.count("dropped_version");
    }
    if env.origin == origin {
        return stats.count("dropped_own");
    }
    let scope = Scope {
        model: env.model_name,
        tenant: env.tenant_id,
    };
    use wire::envelope::Event;
    let outcome = match env.event {
        None => return stats.count("dropped_undecodable"),
        Some(Event::Admission(a)) => {
            let hashes: Vec<SequenceHash> =
                a.sequence_hashes.into_iter().map(SequenceHash).collect();
            sink.admission(
                &scope,
                &a.request_id,
                WorkerRank {
                    worker: a.worker_id,
                    dp_rank: a.dp_rank,
                },
                a.block_size,
                &hashes,
                a.prefill_tokens,
            )
        }
        Some(Event::PrefillComplete(p)) => sink.prefill_complete(&scope, &p.request_id),
        Some(Event::Free(f)) => sink.free(&scope, &f.request_id),
        Some(Event::SessionBound(b)) => sink.session_bound(
            &scope,
            SessionKey(b.session_key),
            WorkerRank {
                worker: b.worker_id,
                dp_rank: b.dp_rank,
            },
        ),
        Some(Event::Routed(r)) => sink.routed(
            &scope,
            r.worker_id,
            r.local_hashes.into_iter().map(LocalBlockHash).collect(),
            r.sequence_hashes.into_iter().map(SequenceHash).collect(),
        ),
    };
    stats.count(match outcome {
        Ok(()) => "applied",
        Err(Refused::Unknown) => "dropped_unknown",
        Err(Refused::Duplicate) => "dropped_duplicate",
    });
}

/// Keeps one SUB task per peer of the latest list, applying what they publish. A list that can no
/// longer change (its sender gone: no HTTP door or Service keeps it) keeps its peers until
/// shutdown.
pub async fn run_subscribers(
    mut peers: watch::Receiver<Vec<String>>,
    origin: u64,
    sink: Arc<dyn Sink>,
    stats: Arc<SyncStats>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut running: HashMap<String, watch::Sender<bool>> = HashMap::new();
    let mut fixed = false;
    loop {
        let wanted = peers.borrow_and_update().clone();
        running.retain(|p, stop| {
            let keep = wanted.contains(p);
            if !keep {
                let _ = stop.send(true);
                tracing::info!(peer = %p, "replica sync peer removed");
            }
            keep
        });
        for p in wanted {
            if running.contains_key(&p) {
                continue;
            }
            let (stop_tx, stop_rx) = watch::channel(false);
            tokio::spawn(subscribe(
                p.clone(),
                origin,
                sink.clone(),
                stats.clone(),
                stop_rx,
            ));
            running.insert(p, stop_tx);
        }
        tokio::select! {
            r = peers.changed(), if !fixed => fixed = r.is_err(),
            r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { break },
        }
    }
    for (_, stop) in running {
        let _ = stop.send(true);
    }
}

async fn subscribe(
    peer: String,
    origin: u64,
    sink: Arc<dyn Sink>,
    stats: Arc<SyncStats>,
    mut stop: watch::Receiver<bool>,
) {
    let mut delay = RECONNECT_MIN;
    loop {
        let mut sub = SubSocket::new();
        let connected = async {
            sub.connect(&peer).await?;
            sub.subscribe("").await
        };
        match connected.await {
            Ok(()) => {
                tracing::info!(peer = %peer, "replica sync subscribed");
                delay = RECONNECT_MIN;
                loop {
                    let msg = tokio::select! {
                        m = sub.recv() => m,
                        _ = stop.changed() => return,
                    };
                    match msg {
                        Ok(m) => {
                            for frame in m.iter() {
                                receive(frame, origin, sink.as_ref(), &stats);
                            }
                        }
                        Err(e) => {
                            tracing::debug!(peer = %peer, error = %e, "replica sync peer lost");
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::debug!(peer = %peer, error = %e, retry_in = ?delay, "replica sync peer not reachable")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.changed() => return,
        }
        delay = (delay * 2).min(RECONNECT_MAX);
    }
}

/// What a service runs for replica sync: the outbox its routes publish to and the origin that
/// filters its own events.
#[derive(Debug, Clone)]
pub struct Replica {
    pub outbox: Outbox,
    pub bound: Option<String>,
}

/// Starts replica sync when `bind` is set: PUB on it, SUB to every peer in `peers` (as it
/// changes), received events applied through `sink`. Without `bind`, a disabled outbox.
pub(crate) async fn start(
    bind: Option<&str>,
    peers: watch::Receiver<Vec<String>>,
    sink: Arc<dyn Sink>,
    stats: Arc<SyncStats>,
    shutdown: watch::Receiver<bool>,
) -> Result<Replica, ReplicaError> {
    let Some(bind) = bind else {
        return Ok(Replica {
            outbox: Outbox::disabled(),
            bound: None,
        });
    };
    let (outbox, bound) = start_publisher(bind, stats.clone(), shutdown.clone()).await?;
    tokio::spawn(run_subscribers(peers, outbox.origin, sink, stats, shutdown));
    Ok(Replica {
        outbox,
        bound: Some(bound),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<String>>);

    impl Sink for Recorder {
        fn admission(
            &self,
            scope: &Scope,
            id: &str,
            rank: WorkerRank,
            bs: u32,
            hashes: &[SequenceHash],
            prefill: u64,
        ) -> Result<(), Refused> {
            if scope.model == "unknown" {
                return Err(Refused::Unknown);
            }
            let mut v = self.0.lock().unwrap();
            v.push(format!(
                "add {} {} {}/{} bs{bs} {:?} {prefill}",
                scope.model,
                id,
                rank.worker,
                rank.dp_rank,
                hashes.iter().map(|h| h.0).collect::<Vec<_>>()
            ));
            Ok(())
        }
        fn prefill_complete(&self, _: &Scope, id: &str) -> Result<(), Refused> {
            self.0.lock().unwrap().push(format!("prefill {id}"));
            Ok(())
        }
        fn free(&self, _: &Scope, id: &str) -> Result<(), Refused> {
            self.0.lock().unwrap().push(format!("free {id}"));
            Err(Refused::Duplicate)
        }
        fn routed(
            &self,
            _: &Scope,
            _: u64,
            _: Vec<LocalBlockHash>,
            _: Vec<SequenceHash>,
        ) -> Result<(), Refused> {
            Err(Refused::Unknown)
        }
        fn session_bound(&self, _: &Scope, k: SessionKey, r: WorkerRank) -> Result<(), Refused> {
            let mut v = self.0.lock().unwrap();
            v.push(format!("session {:x} {}/{}", k.0, r.worker, r.dp_rank));
            Ok(())
        }
    }

    fn scope(m: &str) -> Scope {
        Scope {
            model: m.into(),
            tenant: "default".into(),
        }
    }

    /// A peer list nobody can change any more (no HTTP door or Service holds its sender) keeps its
    /// subscriptions: events still arrive over real ZMQ sockets.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn subscriptions_outlive_a_peer_list_that_can_no_longer_change() {
        let (stop_tx, stop_rx) = watch::channel(false);
        let (out, bound) = start_publisher("tcp://127.0.0.1:0", Arc::default(), stop_rx.clone())
            .await
            .unwrap();
        let (peers_tx, peers_rx) = watch::channel(vec![bound]);
        drop(peers_tx);
        let sink = Arc::new(Recorder::default());
        let stats = Arc::new(SyncStats::default());
        tokio::spawn(run_subscribers(
            peers_rx,
            out.origin() ^ 1,
            sink.clone(),
            stats.clone(),
            stop_rx,
        ));
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while stats.get("received") == 0 {
            assert!(std::time::Instant::now() < deadline, "no event received");
            out.prefill_complete(&scope("m"), "r");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(sink.0.lock().unwrap().iter().any(|e| e == "prefill r"));
        let _ = stop_tx.send(true);
    }

    #[tokio::test]
    async fn events_round_trip_and_bad_ones_are_counted() {
        let (tx, mut rx) = mpsc::channel(5);
        let out = Outbox {
            tx: Some(tx),
            origin: 7,
            stats: Arc::default(),
        };
        let rank = WorkerRank {
            worker: u64::MAX,
            dp_rank: 3,
        };
        out.admission(
            &scope("m"),
            "r1",
            rank,
            16,
            &[SequenceHash(u64::MAX), SequenceHash(1)],
            48,
        );
        out.prefill_complete(&scope("m"), "r1");
        out.free(&scope("m"), "r1");
        out.admission(&scope("unknown"), "r2", rank, 16, &[], 0);
        out.session_bound(&scope("m"), SessionKey(u64::MAX - 1), rank);
        out.free(&scope("m"), "r3"); // queue of 5: dropped
        assert_eq!(out.stats.get("dropped_queue_full"), 1);

        let sink = Recorder::default();
        let stats = SyncStats::default();
        for _ in 0..5 {
            let m = rx.recv().await.unwrap();
            receive(&m, 99, &sink, &stats);
        }
        // Our own event, another version, garbage.
        let own = rx.try_recv().is_err();
        assert!(own, "nothing else queued");
        let mut env = wire::Envelope {
            version: WIRE_VERSION,
            origin: 99,
            model_name: "m".into(),
            tenant_id: "default".into(),
            event: Some(wire::envelope::Event::Free(wire::Free {
                request_id: "x".into(),
            })),
        };
        receive(&env.encode_to_vec(), 99, &sink, &stats);
        env.origin = 1;
        env.version = 2;
        receive(&env.encode_to_vec(), 99, &sink, &stats);
        receive(b"\xff\xff\xff", 99, &sink, &stats);
        assert_eq!(
            *sink.0.lock().unwrap(),
            [
                format!("add m r1 {}/3 bs16 [{}, 1] 48", u64::MAX, u64::MAX),
                "prefill r1".to_string(),
                "free r1".to_string(),
                format!("session {:x} {}/3", u64::MAX - 1, u64::MAX),
            ]
        );
        for (outcome, n) in [
            ("received", 8),
            ("applied", 3),
            ("dropped_duplicate", 1),
            ("dropped_unknown", 1),
            ("dropped_own", 1),
            ("dropped_version", 1),
            ("dropped_undecodable", 1),
        ] {
            assert_eq!(stats.get(outcome), n, "{outcome}");
        }
    }
}

/// The replica-sync settings of `kvepp serve` (the slot tracker's flags, plus discovery).
#[derive(
    Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaSyncConfig {
    /// ZMQ PUB endpoint to bind, e.g. `tcp://*:9094`; unset: replica sync off.
    pub bind: Option<String>,
    /// The bound endpoint as peers reach it (never taken as a peer).
    pub advertise: Option<String>,
    /// Peer PUB endpoints.
    pub peers: Vec<String>,
    /// Kubernetes: peers are the ready endpoints of this Service (kvepp's own) at the bind port.
    pub peers_service: Option<String>,
    /// On start, the KV index is recovered from the first of these peers' `GET /dump` (another
    /// replica's metrics port, e.g. `http://kvepp-0.kvepp:9090`) before ext_proc streams are served.
    pub indexer_peers: Vec<String>,
}

impl ReplicaSyncConfig {
    /// The port of the bind endpoint (`tcp://host:port`).
    pub fn port(&self) -> Option<u16> {
        self.bind
            .as_deref()?
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
    }

    /// Every problem with the settings.
    pub fn problems(&self) -> Vec<String> {
        use peers::validate_endpoint;
        let mut out = Vec::new();
        if let Some(b) = &self.bind {
            if let Err(e) = validate_endpoint(&bindable(b)) {
                out.push(format!("bind: {e}"));
            }
        } else if !self.peers.is_empty() || self.peers_service.is_some() || self.advertise.is_some()
        {
            out.push("peers, peers_service and advertise need bind".into());
        }
        for u in &self.indexer_peers {
            if !u.starts_with("http://") {
                out.push(format!("indexer_peers: {u:?} is not an http:// URL"));
            }
        }
        for p in self.peers.iter().chain(&self.advertise) {
            if let Err(e) = validate_endpoint(p) {
                out.push(e);
            }
        }
        out
    }
}
