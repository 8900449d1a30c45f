//! Pacing of kvepp's background loops (discovery-driven fetchers, scrapers, subscription managers):
//! a fixed period that never bursts to catch up, and a prompt stop on shutdown.

use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Interval, MissedTickBehavior};

pub struct Pace {
    tick: Interval,
    shutdown: watch::Receiver<bool>,
}

impl Pace {
    pub(crate) fn new(period: Duration, shutdown: watch::Receiver<bool>) -> Self {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Pace { tick, shutdown }
    }

    /// A new period, from the next tick on (live reconfiguration); the same period: nothing.
    pub(crate) fn set_period(&mut self, period: Duration) {
        if period != self.tick.period() {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            self.tick = tick;
        }
    }

    /// Waits for the next period; false once shutdown has been requested.
    pub(crate) async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.tick.tick() => {}
            _ = self.shutdown.changed() => {}
        }
        !*self.shutdown.borrow()
    }
}
