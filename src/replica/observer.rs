//! `kvepp serve`'s side of replica sync: the picker's own bookings (ext_proc picks) published to
//! the other replicas, under ids made global by this process's origin.
//!
//! Invariant: a local booking id (`\0<n>`, never one a client can send) becomes `<origin>-<n>` on
//! the wire, the same for its admission, prefill completion and free.

use kvepp_core::catalog::Scope;
use kvepp_core::kv::{BookingObserver, PromptBlocks};
use kvepp_core::slots::WorkerRank;
use kvepp_core::SequenceHash;

use super::Outbox;

#[derive(Debug)]
pub struct PublishBookings {
    pub outbox: Outbox,
    /// The scope the pool's events travel under.
    pub scope: Scope,
}

impl PublishBookings {
    fn global(&self, id: &str) -> String {
        format!(
            "{:016x}-{}",
            self.outbox.origin(),
            id.trim_start_matches('\0')
        )
    }
}

impl BookingObserver for PublishBookings {
    fn admitted(
        &self,
        id: &str,
        rank: WorkerRank,
        block_size: u32,
        hashes: &[SequenceHash],
        prefill_tokens: u64,
    ) {
        self.outbox.admission(
            &self.scope,
            &self.global(id),
            rank,
            block_size,
            hashes,
            prefill_tokens,
        );
    }

    fn prefill_complete(&self, id: &str) {
        self.outbox.prefill_complete(&self.scope, &self.global(id));
    }

    fn freed(&self, id: &str) {
        self.outbox.free(&self.scope, &self.global(id));
    }

    fn routed(&self, worker: u64, prompt: &PromptBlocks) {
        self.outbox
            .routed(&self.scope, worker, &prompt.locals, &prompt.hashes);
    }
}
