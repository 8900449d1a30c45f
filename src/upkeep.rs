//! The routing core's upkeep, whatever the picker: endpoints that leave the pool are forgotten
//! (cached prefixes, approximate prefixes, load) as soon as the pool's snapshot changes, and
//! bookings whose end was never seen expire on a slow tick.
//!
//! Invariant: after every pool change the router holds state only for endpoints in the pool
//! (cached prefixes, approximate prefixes, load), so a pick never sees state of an endpoint it
//! cannot route to for long, and an address that returns starts clean.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvepp_core::{Endpoint, Router};
use tokio::sync::watch;

/// How often stale bookings are looked for.
pub(crate) const EXPIRE_EVERY: Duration = Duration::from_secs(1);

/// Runs until `shutdown` turns true.
pub(crate) async fn run(
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
            tracing::info!(endpoint = %gone, "endpoint left the pool: its routing state is forgotten");
        }
        // Whatever the router holds for an endpoint not in the pool goes, including one that came
        // and went between two wake-ups.
        let forgotten = router.retain(now.iter().map(|a| &**a));
        if forgotten > 0 {
            tracing::debug!(forgotten, "routing state of departed endpoints dropped");
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

#[cfg(test)]
mod tests {

    use kvepp_core::{KvSettings, KvState, PickContext, Prompt, RequestFacts, Saturation};

    use super::*;

    fn endpoint(port: u16) -> Arc<Endpoint> {
        Arc::new(Endpoint::new(
            ([10, 0, 0, 1], port).into(),
            format!("pod-{port}"),
        ))
    }

    /// Approximate-prefix mode runs no KV-event manager; the upkeep alone must forget an endpoint
    /// that leaves the pool.
    #[tokio::test]
    async fn departed_endpoints_are_forgotten_in_approximate_mode() {
        let kv = Arc::new(KvState::new(KvSettings {
            approximate_only: true,
            ..KvSettings::default()
        }));
        let router = Arc::new(Router::kv_aware(kv.clone(), Saturation::in_flight(0)));
        let (a, b) = (endpoint(1), endpoint(2));
        let (pool_tx, pool_rx) = watch::channel::<Arc<[Arc<Endpoint>]>>(vec![a.clone()].into());
        let (stop_tx, stop_rx) = watch::channel(false);
        let task = tokio::spawn(run(router.clone(), pool_rx, stop_rx));

        let text = vec![b'x'; 256];
        let facts = RequestFacts {
            model: Some("m"),
            prompt: Prompt::Text {
                scope: "m",
                bytes: &text,
            },
            ..RequestFacts::default()
        };
        let held = router
            .route(
                facts.clone(),
                std::slice::from_ref(&a),
                &mut PickContext::seeded(1),
            )
            .expect("routed");
        assert_eq!(kv.load(&a.addr_str).map(|l| l.active_requests), Some(1));

        // Sent before the task ever ran: it must still forget `a`, which it never saw in a
        // snapshot.
        pool_tx.send_replace(vec![b.clone()].into());
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        while kv.load(&a.addr_str).is_some() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "endpoint not forgotten"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // Its approximate prefix is gone too: the same prompt finds nothing cached on it.
        let again = router
            .route(facts, std::slice::from_ref(&a), &mut PickContext::seeded(1))
            .expect("routed");
        assert_eq!(again.pick.kv.map(|d| d.overlap.device), Some(0));
        drop((held, again));

        stop_tx.send_replace(true);
        tokio::time::timeout(std::time::Duration::from_secs(10), task)
            .await
            .expect("upkeep stops on shutdown")
            .expect("upkeep task");
    }
}
