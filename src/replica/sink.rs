//! Applying peers' lifecycle events to a worker catalog (the selection service, the slot tracker,
//! and `kvepp serve`'s pooled catalog). An event is applied only to what this process already knows:
//! a registered (model, tenant) with the same block size, a registered worker and rank; replica
//! traffic never creates workers. A peer's booking is recorded by id ([`Catalog::record_peer`]),
//! never through the router's transaction: it was decided on the peer, and recording it tells no
//! listener, so it is never published back.

use parking_lot::RwLock;
use std::sync::Arc;
use std::time::Instant;

use super::{Refused, Sink};
use kvepp_core::affinity::SessionKey;
use kvepp_core::catalog::{Catalog, CatalogError, Origin, Scope};
use kvepp_core::slots::WorkerRank;
use kvepp_core::{LocalBlockHash, SequenceHash};

/// How request ids are scoped by the service the catalog belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ids {
    /// Per (model, tenant): the slot tracker.
    Scoped,
    /// Global (the lifecycle routes name only the id): the selection service, `kvepp serve`.
    Global,
}

#[derive(Debug, Clone)]
pub struct CatalogSink {
    pub catalog: Arc<RwLock<Catalog>>,
    pub ids: Ids,
}

impl CatalogSink {
    /// The scope a request id lives in: its (model, tenant) for scoped ids, none for global ones.
    fn scope_of_ids<'a>(&self, scope: &'a Scope) -> Option<&'a Scope> {
        (self.ids == Ids::Scoped).then_some(scope)
    }
}

fn refused(e: CatalogError) -> Refused {
    match e {
        CatalogError::DuplicateReservation(_) => Refused::Duplicate,
        _ => Refused::Unknown,
    }
}

impl Sink for CatalogSink {
    fn admission(
        &self,
        scope: &Scope,
        request_id: &str,
        rank: WorkerRank,
        block_size: u32,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
    ) -> Result<(), Refused> {
        let catalog = self.catalog.read();
        let tracker = catalog.tracker(scope).map_err(refused)?;
        if tracker.block_size() != block_size {
            return Err(Refused::Unknown);
        }
        catalog
            .record_peer(
                scope,
                request_id,
                rank,
                hashes,
                prefill_tokens,
                self.ids == Ids::Scoped,
                Instant::now(),
            )
            .map_err(refused)
    }

    fn prefill_complete(&self, scope: &Scope, request_id: &str) -> Result<(), Refused> {
        self.catalog
            .read()
            .prefill_complete_by(self.scope_of_ids(scope), request_id, Origin::Peer)
            .map_err(|_| Refused::Unknown)
    }

    fn free(&self, scope: &Scope, request_id: &str) -> Result<(), Refused> {
        let freed = self
            .catalog
            .read()
            .free_by(self.scope_of_ids(scope), request_id, Origin::Peer);
        if freed {
            Ok(())
        } else {
            Err(Refused::Unknown)
        }
    }

    fn session_bound(
        &self,
        scope: &Scope,
        key: SessionKey,
        rank: WorkerRank,
    ) -> Result<(), Refused> {
        let catalog = self.catalog.read();
        let tracker = catalog.tracker(scope).map_err(refused)?;
        let known = tracker
            .workers
            .get(&rank.worker)
            .is_some_and(|w| w.has_rank(rank.dp_rank));
        if !known {
            return Err(Refused::Unknown);
        }
        tracker
            .router()
            .bind_peer_session(key, rank, Instant::now(), std::time::Duration::ZERO);
        Ok(())
    }

    fn routed(
        &self,
        scope: &Scope,
        worker: u64,
        locals: Vec<LocalBlockHash>,
        hashes: Vec<SequenceHash>,
    ) -> Result<(), Refused> {
        let catalog = self.catalog.read();
        let tracker = catalog.tracker(scope).map_err(refused)?;
        if !tracker.workers.contains_key(&worker) || locals.len() != hashes.len() {
            return Err(Refused::Unknown);
        }
        tracker.kv.record_routed(worker, locals, hashes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvepp_core::catalog::{Limits, Worker};
    use kvepp_core::KvSettings;

    /// A peer's session binding is applied for a rank this replica knows, and dropped for an
    /// unknown worker, rank or scope.
    #[test]
    fn peer_session_bindings_apply_only_to_known_ranks() {
        let scope = Scope {
            model: "m".into(),
            tenant: "default".into(),
        };
        let mut c = Catalog::new(KvSettings::default(), Limits::default());
        c.register(
            scope.clone(),
            Worker {
                worker_id: 7,
                block_size: 16,
                dp_start: 0,
                dp_size: 2,
                endpoint: None,
                kv_events_endpoints: Default::default(),
                replay_endpoint: None,
            },
        )
        .unwrap();
        let sink = CatalogSink {
            catalog: Arc::new(RwLock::new(c)),
            ids: Ids::Global,
        };
        let rank = |worker, dp_rank| WorkerRank { worker, dp_rank };
        let key = SessionKey::of("s");
        assert_eq!(sink.session_bound(&scope, key, rank(7, 1)), Ok(()));
        assert_eq!(
            sink.session_bound(&scope, key, rank(8, 0)),
            Err(Refused::Unknown)
        );
        assert_eq!(
            sink.session_bound(&scope, key, rank(7, 2)),
            Err(Refused::Unknown)
        );
        let other = Scope {
            model: "x".into(),
            ..scope.clone()
        };
        assert_eq!(
            sink.session_bound(&other, key, rank(7, 0)),
            Err(Refused::Unknown)
        );
        let catalog = sink.catalog.read();
        let sessions = catalog.tracker(&scope).unwrap().router().sessions();
        let now = kvepp_core::types::clock_nanos(Instant::now());
        assert_eq!(sessions.get(key, now), Some(rank(7, 1)));
    }
}
