//! The routing core's upkeep, whatever the picker: endpoints that leave the pool are forgotten
//! (cached prefixes, approximate prefixes, load) as soon as the pool's snapshot changes, and
//! bookings whose end was never seen expire on a slow tick.
//!
//! Invariant: an endpoint is forgotten once per departure, after it is gone from the snapshot the
//! request path reads, so a pick never sees state of an endpoint it cannot route to for long.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvepp_core::{Endpoint, Router};
use tokio::sync::watch;

/// How often stale bookings are looked for.
pub const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// Runs until `shutdown` turns true.
pub async fn run(
    router: Arc<Router>,
    mut pool: watch::Receiver<Arc<[Arc<Endpoint>]>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut known: HashSet<Arc<str>> = HashSet::new();
    let mut tick = tokio::time::interval(EXPIRE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let endpoints = pool.borrow_and_update().clone();
        let now: HashSet<Arc<str>> = endpoints.iter().map(|e| e.addr_str.clone()).collect();
        for gone in known.difference(&now) {
            router.forget(gone);
            tracing::info!(endpoint = %gone, "endpoint left the pool: its routing state is forgotten");
        }
        known = now;
        loop {
            tokio::select! {
                r = pool.changed() => {
                    if r.is_err() {
                        return;
                    }
                    break;
                }
                _ = tick.tick() => {
                    router.maintain(Instant::now());
                }
                _ = shutdown.changed() => {
                    if *shutdown.borrow() {
                        return;
                    }
                }
            }
        }
    }
}
