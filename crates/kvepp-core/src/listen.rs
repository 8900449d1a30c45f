//! Who hears about bookings: a [`Hub`] of [`Listener`]s that every booking guard reaches when its
//! request is admitted, completes prefill, is freed, or releases its load.
//!
//! It owns only the list. Invariants: listeners are called after the state's locks are released
//! and must not block; a booking made through the router tells the hub of its router (the same
//! hub its KV-aware state holds), so flow control, replica sync and metrics hang off one place and
//! no caller pairs a release with a notification of its own; adding a listener never blocks a
//! booking (the list is swapped whole).

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::affinity::SessionKey;
use crate::hash::SequenceHash;
use crate::types::PromptBlocks;
use crate::types::WorkerRank;

/// What a booking's admission tells its listeners.
#[derive(Debug, Clone, Copy)]
pub struct Admitted<'a> {
    /// The booking's id in the slot tracker: `\0<n>` for a process-local id (never one a client
    /// can send), else the client's reservation id.
    pub id: &'a str,
    pub rank: WorkerRank,
    pub block_size: u32,
    pub hashes: &'a [SequenceHash],
    pub prefill_tokens: u64,
}

/// Told about every booking the core makes and ends. Every method has a default that does
/// nothing, so a listener implements only what it cares for.
pub trait Listener: Send + Sync + std::fmt::Debug {
    /// A slot-tracker booking was made.
    fn admitted(&self, _a: &Admitted<'_>) {}
    /// The booking's prefill is over (first response byte, or the client said so).
    fn prefill_complete(&self, _id: &str) {}
    /// The booking's slot-tracker entry was freed (not when it had expired already).
    fn freed(&self, _id: &str) {}
    /// Approximate mode: the prompt's blocks were recorded as routed to `worker`.
    fn routed(&self, _worker: u64, _prompt: &PromptBlocks) {}
    /// A booking released its endpoint's load (whatever the picker): capacity may have freed.
    fn released(&self) {}
    /// A routed request bound (or refreshed) its session to `rank`.
    fn session_bound(&self, _key: SessionKey, _rank: WorkerRank) {}
}

/// The listeners of one router (and of its KV-aware state).
#[derive(Debug, Default)]
pub struct Hub {
    listeners: ArcSwap<Vec<Arc<dyn Listener>>>,
}

impl Hub {
    /// Adds a listener; bookings made from now on reach it.
    pub fn listen(&self, l: Arc<dyn Listener>) {
        self.listeners.rcu(|old| {
            let mut v = Vec::clone(old);
            v.push(l.clone());
            v
        });
    }

    /// Whether anyone listens (the booking path skips building events otherwise).
    pub fn is_empty(&self) -> bool {
        self.listeners.load().is_empty()
    }

    /// Calls `f` on every listener.
    pub fn each(&self, f: impl Fn(&dyn Listener)) {
        for l in self.listeners.load().iter() {
            f(l.as_ref());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Debug, Default)]
    struct Count(AtomicUsize);

    impl Listener for Count {
        fn released(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn every_listener_hears_and_defaults_do_nothing() {
        let hub = Hub::default();
        assert!(hub.is_empty());
        let a = Arc::new(Count::default());
        let b = Arc::new(Count::default());
        hub.listen(a.clone());
        hub.listen(b.clone());
        hub.each(|l| l.released());
        hub.each(|l| l.freed("x"));
        assert_eq!(a.0.load(Ordering::Relaxed), 1);
        assert_eq!(b.0.load(Ordering::Relaxed), 1);
        assert!(!hub.is_empty());
    }
}
