//! What `kvepp serve` shares beyond Envoy's stream: a pooled catalog over the picker's own state
//! (its workers are the pool's ready endpoints), replica sync with the other kvepp replicas, and
//! the HTTP doors (selection service, slot tracker) over that same state.
//!
//! Invariants: one picker state behind every door; with replica sync on, every pick and release of
//! this replica reaches the others (and theirs reach it, applied only for endpoints this replica
//! also sees); the peer list is shared by replica sync and the doors' peer routes.

use parking_lot::RwLock;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use super::ServerError;
use crate::api::auth::Access;
use crate::api::select::SelectState;
use crate::api::slot_tracker::{pool_scope, SlotTrackerState};
use crate::config::Config;
use crate::discovery::{Datastore, ServiceDiscovery};
use crate::replica::observer::PublishBookings;
use crate::replica::peers::{Peers, SharedPeers};
use crate::replica::sink::{CatalogSink, Ids};
use crate::replica::SyncStats;
use kvepp_core::catalog::{Catalog, Limits};
use kvepp_core::Router;

type Tasks = Vec<tokio::task::JoinHandle<()>>;

/// A catalog over `router` (its KV-aware state and its own transaction) whose candidates follow
/// the pool's ready endpoints.
fn pooled_catalog(
    router: &Arc<Router>,
    store: &Arc<Datastore>,
    stop: &watch::Receiver<bool>,
    tasks: &mut Tasks,
) -> Option<Arc<RwLock<Catalog>>> {
    let catalog = Arc::new(RwLock::new(Catalog::pooled(
        router.clone(),
        Limits::default(),
    )?));
    // Reservations whose requests went stale (the router's upkeep expires them in the shared
    // state) give their bookings back.
    tasks.push(tokio::spawn(crate::standalone::expire_loop(
        catalog.clone(),
        stop.clone(),
    )));
    let sync = catalog.clone();
    let mut pool = store.watch();
    let mut stop = stop.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            let endpoints = pool.borrow_and_update().clone();
            sync.write().set_pool(endpoints.to_vec());
            tokio::select! {
                r = pool.changed() => if r.is_err() { return },
                _ = stop.changed() => if *stop.borrow() { return },
            }
        }
    }));
    Some(catalog)
}

/// The listeners of `kvepp serve`'s Dynamo-compatible HTTP doors, each when configured.
#[derive(Debug)]
pub struct Doors {
    /// The selection service's.
    pub select: Option<TcpListener>,
    /// The slot tracker's.
    pub slots: Option<TcpListener>,
}

/// Starts what is configured among replica sync and the HTTP doors; returns the doors' servers.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn start(
    cfg: &Config,
    router: &Arc<Router>,
    store: &Arc<Datastore>,
    discovery: Arc<dyn ServiceDiscovery>,
    doors: Doors,
    access: &Access,
    limits: &Arc<crate::admission::RateLimiter>,
    stats: Arc<SyncStats>,
    stop: &watch::Receiver<bool>,
    tasks: &mut Tasks,
) -> Result<Vec<tokio::task::JoinHandle<std::io::Result<()>>>, ServerError> {
    let rs = &cfg.replica_sync;
    let Doors { select, slots } = doors;
    if rs.bind.is_none() && select.is_none() && slots.is_none() {
        return Ok(Vec::new());
    }
    let Some(catalog) = pooled_catalog(router, store, stop, tasks) else {
        return Ok(Vec::new());
    };
    let peers = Arc::new(SharedPeers::new(
        Peers::new(rs.peers.clone(), rs.advertise.clone()).map_err(|message| {
            ServerError::Serve {
                what: "replica sync",
                message,
            }
        })?,
    ));
    // Tenant rate limits: each replica enforces its share (itself and its peers).
    limits.set_replicas(peers.list().len() + 1);
    let mut replicas = peers.subscribe();
    let (share, mut halt) = (limits.clone(), stop.clone());
    tasks.push(tokio::spawn(async move {
        loop {
            share.set_replicas(replicas.borrow_and_update().len() + 1);
            tokio::select! {
                c = replicas.changed() => if c.is_err() { return },
                _ = halt.changed() => return,
            }
        }
    }));
    let sink = Arc::new(CatalogSink {
        catalog: catalog.clone(),
        ids: Ids::Global,
    });
    let replica = crate::replica::start(
        rs.bind.as_deref(),
        peers.subscribe(),
        sink,
        stats,
        stop.clone(),
    )
    .await?;
    let outbox = replica.outbox.clone();
    if replica.bound.is_some() {
        router.listen(Arc::new(PublishBookings {
            outbox: outbox.clone(),
            scope: pool_scope(),
        }));
        if let (Some(service), Some(port)) = (&rs.peers_service, rs.port()) {
            tracing::info!(service = %service, port, "replica-sync peers from the Service's endpoints");
            tasks.push(tokio::spawn(follow_service(
                discovery,
                cfg.pool_namespace.clone(),
                service.clone(),
                port,
                peers.clone(),
                stop.clone(),
            )));
        }
    }
    Ok(open_http_doors(
        &catalog, select, slots, access, &peers, stop,
    ))
}

/// `kvepp serve` on Kubernetes: the replica-sync peers are the ready endpoints of kvepp's own
/// Service (its EndpointSlices), at the replica-sync port, so scaling the Deployment needs no
/// configuration. Runs until `shutdown`; the peer list follows every change.
pub(crate) async fn follow_service(
    discovery: Arc<dyn crate::discovery::ServiceDiscovery>,
    namespace: String,
    service: String,
    port: u16,
    peers: Arc<SharedPeers>,
    mut shutdown: watch::Receiver<bool>,
) {
    use crate::discovery::service::InstanceEvent;
    use futures::StreamExt;
    let mut stream = discovery.watch(&namespace, &service);
    let mut found: std::collections::HashMap<Arc<str>, String> = Default::default();
    loop {
        let event = tokio::select! {
            e = stream.next() => match e { Some(e) => e, None => return },
            _ = shutdown.changed() => if *shutdown.borrow() { return } else { continue },
        };
        match event {
            InstanceEvent::Added(i) => {
                let endpoint = format!("tcp://{}", std::net::SocketAddr::new(i.ip, port));
                found.insert(i.id, endpoint);
            }
            InstanceEvent::Removed(id) => {
                found.remove(&id);
            }
            InstanceEvent::Synced => {}
        }
        peers.set_discovered(found.values().cloned());
    }
}

/// The selection service and slot tracker routes over the pooled catalog.
fn open_http_doors(
    catalog: &Arc<RwLock<Catalog>>,
    select: Option<TcpListener>,
    slots: Option<TcpListener>,
    access: &Access,
    peers: &Arc<SharedPeers>,
    stop: &watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<std::io::Result<()>>> {
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let mut doors = Vec::new();
    if let Some(l) = select {
        tracing::info!(addr = ?l.local_addr().ok(), "selection service door open");
        let state = Arc::new(SelectState::new(catalog.clone(), peers.clone()));
        let app = crate::api::select::router(state, access);
        let shutdown = stopped(stop.clone());
        doors.push(tokio::spawn(async move {
            axum::serve(l, app).with_graceful_shutdown(shutdown).await
        }));
    }
    if let Some(l) = slots {
        tracing::info!(addr = ?l.local_addr().ok(), "slot tracker door open");
        let state = Arc::new(SlotTrackerState {
            catalog: catalog.clone(),
            peers: peers.clone(),
        });
        let app = crate::api::slot_tracker::router(state, access);
        let shutdown = stopped(stop.clone());
        doors.push(tokio::spawn(async move {
            axum::serve(l, app).with_graceful_shutdown(shutdown).await
        }));
    }
    doors
}
