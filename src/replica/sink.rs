//! Applying peers' lifecycle events to a worker catalog (the selection service, the slot tracker,
//! and `kvepp serve`'s pooled catalog). An event is applied only to what this process already knows:
//! a registered (model, tenant) with the same block size, a registered worker and rank; replica
//! traffic never creates workers.

use std::sync::{Arc, RwLock};
use std::time::Instant;

use super::{Refused, Sink};
use crate::api::json::read;
use kvepp_core::catalog::{Catalog, CatalogError, PromptRef, Scope};
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
        let catalog = read(&self.catalog);
        let tracker = catalog.tracker(scope).map_err(refused)?;
        if tracker.block_size() != block_size {
            return Err(Refused::Unknown);
        }
        let now = Instant::now();
        match self.ids {
            Ids::Scoped => catalog.add_scoped(scope, request_id, rank, hashes, prefill_tokens, now),
            Ids::Global => catalog
                .reserve(
                    scope,
                    request_id,
                    rank,
                    PromptRef {
                        hashes,
                        isl_tokens: prefill_tokens,
                    },
                    Some(prefill_tokens),
                    now,
                )
                .map(|_| ()),
        }
        .map(|_| ())
        .map_err(refused)
    }

    fn prefill_complete(&self, scope: &Scope, request_id: &str) -> Result<(), Refused> {
        let catalog = read(&self.catalog);
        match self.ids {
            Ids::Scoped => catalog
                .tracker(scope)
                .map_err(refused)?
                .kv
                .prefill_complete(request_id)
                .map_err(|_| Refused::Unknown),
            Ids::Global => catalog.prefill_complete(request_id).map_err(refused),
        }
    }

    fn free(&self, scope: &Scope, request_id: &str) -> Result<(), Refused> {
        let catalog = read(&self.catalog);
        let freed = match self.ids {
            Ids::Scoped => catalog.tracker(scope).map_err(refused)?.kv.free(request_id),
            Ids::Global => catalog.free(request_id),
        };
        if freed {
            Ok(())
        } else {
            Err(Refused::Unknown)
        }
    }

    fn routed(
        &self,
        scope: &Scope,
        worker: u64,
        locals: Vec<LocalBlockHash>,
        hashes: Vec<SequenceHash>,
    ) -> Result<(), Refused> {
        let catalog = read(&self.catalog);
        let tracker = catalog.tracker(scope).map_err(refused)?;
        if !tracker.workers.contains_key(&worker) || locals.len() != hashes.len() {
            return Err(Refused::Unknown);
        }
        tracker.kv.record_routed(worker, locals, hashes);
        Ok(())
    }
}
