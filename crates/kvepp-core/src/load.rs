//! Per-endpoint in-flight accounting: admitted → first response byte → end of stream or abort.
//!
//! The counters are moved only by a booking (the `booking` module: taken when a request is routed,
//! released when dropped), so every exit path gives the slot back exactly once.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};

pub(crate) use crate::types::clock_nanos;
use std::time::{Duration, Instant};

/// Load signals an engine publishes about itself (its Prometheus `/metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineMetrics {
    pub waiting: f64,
    pub running: f64,
    /// KV-cache usage, 0..1.
    pub kv_cache_usage: f64,
    pub block_size: Option<u32>,
    pub num_gpu_blocks: Option<u64>,
    /// The CPU tier's blocks, when the engine has one (`num_cpu_blocks`).
    pub num_cpu_blocks: Option<u64>,
}

#[derive(Debug)]
pub struct EndpointLoad {
    in_flight: AtomicU32,
    /// Requests admitted that have not produced a response byte yet.
    waiting_first_byte: AtomicU32,
    routed_total: AtomicU64,
    /// When the last booking here was made ([`clock_nanos`]; `i64::MIN`: never): equal-cost
    /// picks go to the endpoint booked least recently.
    booked_at: AtomicI64,
    /// What saturation reads of the engine's last successful scrape, in plain atomics (a
    /// flow-controlled pick checks every candidate): waiting requests and KV-cache usage as f64
    /// bits, the scrape's time as nanoseconds from [`crate::types`]'s `ORIGIN`; `scraped` is set
    /// once they hold a scrape.
    scraped: AtomicBool,
    scraped_waiting: AtomicU64,
    scraped_kv_usage: AtomicU64,
    scraped_at: AtomicI64,
    /// Requests the engine reported at its last scrape beyond those routed here then.
    hidden_requests: AtomicU32,
    /// The endpoint's speed under the pool's TTFT model (the `predicted_ttft` cost).
    pub ttft: std::sync::Arc<crate::predict::EndpointSpeed>,
    /// The LoRA adapters its engine reported last (None: unknown).
    pub(crate) adapters: arc_swap::ArcSwapOption<crate::affinity::AdapterSlots>,
    /// The adapters last routed here (what its idle slots hold).
    pub recent_adapters: crate::affinity::adapters::RecentAdapters,
}

impl Default for EndpointLoad {
    fn default() -> Self {
        EndpointLoad {
            in_flight: AtomicU32::new(0),
            waiting_first_byte: AtomicU32::new(0),
            routed_total: AtomicU64::new(0),
            booked_at: AtomicI64::new(i64::MIN),
            scraped: AtomicBool::new(false),
            scraped_waiting: AtomicU64::new(0),
            scraped_kv_usage: AtomicU64::new(0),
            scraped_at: AtomicI64::new(0),
            hidden_requests: AtomicU32::new(0),
            ttft: Default::default(),
            adapters: Default::default(),
            recent_adapters: Default::default(),
        }
    }
}

impl EndpointLoad {
    /// Requests routed here and not yet finished.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Requests routed here still waiting for their first response byte.
    pub fn waiting_first_byte(&self) -> u32 {
        self.waiting_first_byte.load(Ordering::Relaxed)
    }

    pub fn routed_total(&self) -> u64 {
        self.routed_total.load(Ordering::Relaxed)
    }

    /// When the last booking here was made, as [`clock_nanos`] counts (`i64::MIN`: never).
    pub fn booked_at(&self) -> i64 {
        self.booked_at.load(Ordering::Relaxed)
    }

    /// Records a successful scrape of the engine's metrics.
    pub fn engine_update(&self, m: EngineMetrics, at: Instant) {
        self.engine_update_known(m, at, None);
    }

    /// [`Self::engine_update`], with `tracked` the requests kvepp's slot tracker holds on this
    /// engine at the same moment: this process's bookings and, with replica sync, its peer
    /// replicas'. Those are known load, not hidden traffic (counting a peer's requests both as
    /// booked load and as hidden requests weighed them twice, and the hidden count is as stale
    /// as the last scrape).
    pub fn engine_update_known(&self, m: EngineMetrics, at: Instant, tracked: Option<u32>) {
        // Compared with our counts now, at the same moment (a later comparison would read stale
        // engine figures against fresh counts).
        let requests = m.running.max(0.0) + m.waiting.max(0.0);
        let known = self.in_flight().max(tracked.unwrap_or(0));
        let hidden = (requests.min(f64::from(u32::MAX)) as u32).saturating_sub(known);
        self.hidden_requests.store(hidden, Ordering::Relaxed);
        self.scraped_waiting
            .store(m.waiting.to_bits(), Ordering::Relaxed);
        self.scraped_kv_usage
            .store(m.kv_cache_usage.to_bits(), Ordering::Relaxed);
        self.scraped_at.store(clock_nanos(at), Ordering::Relaxed);
        self.scraped.store(true, Ordering::Release);
    }

    /// Requests the engine reported at its last scrape beyond those kvepp knew of on it at that
    /// moment (routed here and not finished, or booked by a peer replica): another client's
    /// traffic (0 without engine metrics).
    pub fn hidden_requests(&self) -> u32 {
        self.hidden_requests.load(Ordering::Relaxed)
    }

    /// The last scrape's waiting requests and KV-cache usage, and its age at `now` (None: never
    /// scraped successfully): what saturation reads, without touching the full metrics.
    pub fn saturation_inputs(&self, now: Instant) -> Option<(f64, f64, Duration)> {
        self.saturation_inputs_at(clock_nanos(now))
    }

    /// [`Self::saturation_inputs`] with `now` already converted by [`clock_nanos`] (once per
    /// pick, not once per candidate).
    #[inline]
    pub(crate) fn saturation_inputs_at(&self, now: i64) -> Option<(f64, f64, Duration)> {
        if !self.scraped.load(Ordering::Acquire) {
            return None;
        }
        let age = now.saturating_sub(self.scraped_at.load(Ordering::Relaxed));
        Some((
            f64::from_bits(self.scraped_waiting.load(Ordering::Relaxed)),
            f64::from_bits(self.scraped_kv_usage.load(Ordering::Relaxed)),
            Duration::from_nanos(u64::try_from(age).unwrap_or(0)),
        ))
    }

    /// The engine's adapters as last reported (None: it never reported any).
    pub fn adapters(&self) -> Option<std::sync::Arc<crate::affinity::AdapterSlots>> {
        self.adapters.load_full()
    }

    /// Records the adapters a scrape found (None: the engine stopped reporting them, which
    /// leaves the adapters its metadata listed, if any).
    pub fn set_adapters(&self, slots: Option<crate::affinity::AdapterSlots>) {
        match slots {
            Some(s) => self.adapters.store(Some(std::sync::Arc::new(s))),
            None => {
                self.adapters
                    .rcu(|cur| cur.as_ref().filter(|c| c.from_metadata).cloned());
            }
        }
    }

    /// Records the adapters the engine's metadata lists, unless its metrics report them.
    pub fn set_metadata_adapters(&self, slots: crate::affinity::AdapterSlots) {
        let slots = std::sync::Arc::new(crate::affinity::AdapterSlots {
            from_metadata: true,
            ..slots
        });
        self.adapters.rcu(|cur| match cur {
            Some(c) if !c.from_metadata => Some(c.clone()),
            _ => Some(slots.clone()),
        });
    }

    /// Counts one more request routed here (a booking was made).
    pub(crate) fn admit(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.waiting_first_byte.fetch_add(1, Ordering::Relaxed);
        self.routed_total.fetch_add(1, Ordering::Relaxed);
        self.booked_at
            .store(clock_nanos(Instant::now()), Ordering::Relaxed);
    }

    /// A request routed here got its first response byte.
    pub(crate) fn first_byte_done(&self) {
        self.waiting_first_byte.fetch_sub(1, Ordering::Relaxed);
    }

    /// A request routed here ended (`first_byte_seen`: whether [`Self::first_byte_done`] ran).
    pub(crate) fn finish(&self, first_byte_seen: bool) {
        if !first_byte_seen {
            self.first_byte_done();
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn lifecycle_counts_once() {
        let a = Arc::new(EndpointLoad::default());
        let mut b = a.book();
        let c = a.book();
        assert_eq!((a.in_flight(), a.waiting_first_byte()), (2, 2));
        b.first_byte();
        b.first_byte();
        assert_eq!((a.in_flight(), a.waiting_first_byte()), (2, 1));
        drop(b);
        drop(c);
        assert_eq!(
            (a.in_flight(), a.waiting_first_byte(), a.routed_total()),
            (0, 0, 2)
        );
    }

    #[test]
    fn move_keeps_phase() {
        let a = Arc::new(EndpointLoad::default());
        let other = Arc::new(EndpointLoad::default());
        let mut b = a.book();
        b.first_byte();
        b.move_to(&other);
        assert_eq!(
            (a.in_flight(), other.in_flight(), other.waiting_first_byte()),
            (0, 1, 0)
        );
        drop(b);
        assert_eq!(other.in_flight(), 0);
    }

    #[test]
    fn saturation_inputs_are_the_last_scrape_with_its_age_on_either_side_of_the_origin() {
        let load = EndpointLoad::default();
        let now = Instant::now();
        assert_eq!(load.saturation_inputs(now), None, "never scraped");
        let m = EngineMetrics {
            waiting: 3.0,
            kv_cache_usage: 0.5,
            ..EngineMetrics::default()
        };
        // An instant before the clock's origin (set at first use) and one after it.
        let before = now.checked_sub(Duration::from_millis(1500)).unwrap_or(now);
        load.engine_update(m, before);
        let (w, kv, age) = load.saturation_inputs(now).unwrap();
        assert_eq!((w, kv), (3.0, 0.5));
        assert_eq!(age, now.duration_since(before));
        let later = now + Duration::from_secs(7);
        load.engine_update(EngineMetrics { waiting: 9.0, ..m }, later);
        let (w, _, age) = load
            .saturation_inputs(later + Duration::from_millis(250))
            .unwrap();
        assert_eq!((w, age), (9.0, Duration::from_millis(250)));
        // A scrape "after" now (clock skew between threads) reads as age 0, never negative.
        assert_eq!(load.saturation_inputs(now).unwrap().2, Duration::ZERO);
    }

    #[test]
    fn metrics_adapters_win_over_metadata_and_a_scrape_without_them_keeps_metadata() {
        use crate::affinity::AdapterSlots;
        let load = EndpointLoad::default();
        let listed = |names: &[&str], from_metadata| AdapterSlots {
            running: names.iter().map(|&n| n.into()).collect(),
            from_metadata,
            ..AdapterSlots::default()
        };
        load.set_metadata_adapters(listed(&["a", "b"], false));
        assert!(load.adapters().unwrap().from_metadata);
        load.set_adapters(None);
        assert_eq!(load.adapters().unwrap().running.len(), 2, "kept");
        load.set_adapters(Some(listed(&["c"], false)));
        load.set_metadata_adapters(listed(&["a", "b"], false));
        assert_eq!(&*load.adapters().unwrap().running[0], "c", "metrics win");
        load.set_adapters(None);
        assert_eq!(load.adapters(), None, "the metric went away: unknown");
    }

    #[test]
    fn hidden_requests_are_those_neither_routed_here_nor_tracked() {
        let load = Arc::new(EndpointLoad::default());
        let _mine = load.book();
        let m = EngineMetrics {
            running: 5.0,
            waiting: 2.0,
            ..EngineMetrics::default()
        };
        let now = Instant::now();
        load.engine_update(m, now);
        assert_eq!(load.hidden_requests(), 6, "7 on the engine, 1 routed here");
        // The slot tracker also holds a peer replica's 4 (and this one's).
        load.engine_update_known(m, now, Some(5));
        assert_eq!(load.hidden_requests(), 2);
        // A tracker that lags this process's own count: the larger one is known.
        load.engine_update_known(m, now, Some(0));
        assert_eq!(load.hidden_requests(), 6);
        load.engine_update_known(m, now, Some(9));
        assert_eq!(load.hidden_requests(), 0, "never below zero");
    }
}
