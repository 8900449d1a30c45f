//! Replica sync's listener on bookings: every booking this process decides (ext_proc picks, and
//! the HTTP doors' reservations) published to the other replicas, under ids made global.
//!
//! Invariant: a process-local booking id (`\0<n>`, never one a client can send) becomes
//! `<origin>-<n>` on the wire, the same for its admission, prefill completion and free; a client's
//! reservation id goes out as it is (its lifecycle routes name it on every replica).

use kvepp_core::affinity::SessionKey;
use kvepp_core::catalog::Scope;
use kvepp_core::kv::PromptBlocks;
use kvepp_core::slots::WorkerRank;
use kvepp_core::{Admitted, Listener};

use super::Outbox;

#[derive(Debug)]
pub struct PublishBookings {
    pub outbox: Outbox,
    /// The scope the bookings' events travel under.
    pub scope: Scope,
}

impl PublishBookings {
    fn global<'a>(&self, id: &'a str) -> std::borrow::Cow<'a, str> {
        match id.strip_prefix('\0') {
            Some(n) => format!("{:016x}-{n}", self.outbox.origin()).into(),
            None => id.into(),
        }
    }
}

impl Listener for PublishBookings {
    fn admitted(&self, a: &Admitted<'_>) {
        self.outbox.admission(
            &self.scope,
            &self.global(a.id),
            a.rank,
            a.block_size,
            a.hashes,
            a.prefill_tokens,
        );
    }

    fn prefill_complete(&self, id: &str) {
        self.outbox.prefill_complete(&self.scope, &self.global(id));
    }

    fn freed(&self, id: &str) {
        self.outbox.free(&self.scope, &self.global(id));
    }

    fn session_bound(&self, key: SessionKey, rank: WorkerRank) {
        self.outbox.session_bound(&self.scope, key, rank);
    }

    fn routed(&self, worker: u64, prompt: &PromptBlocks) {
        self.outbox
            .routed(&self.scope, worker, &prompt.locals, &prompt.hashes);
    }
}
