//! LoRA adapters per engine and what a request for one costs there.
//!
//! An engine (vLLM) holds at most `max_lora` adapters in GPU slots. vLLM's metric names only the
//! adapters of running and waiting requests, not those loaded and idle between requests, so the
//! router also remembers the last distinct adapters it sent to each engine ([`RecentAdapters`]):
//! vLLM evicts the least recently used idle adapter, so those are the ones its slots still hold.
//! A request for an adapter the engine runs, queues or was last sent costs nothing extra; one with a free slot costs a load; one that
//! must evict an adapter costs a load plus the eviction (requests of the evicted adapter load it
//! again, and vLLM waits for the adapter's running requests before it can evict). A saturated
//! engine loses its adapter advantage: holding the adapter or with a slot free, it costs what an
//! eviction costs (so an unsaturated engine with a free slot goes first), and still less than an
//! engine that must load the adapter and evict another (so of two engines equally saturated,
//! the one holding the adapter keeps it). An engine whose adapters are unknown (no metric yet, or not vLLM)
//! gets no adapter term at all: no preference, never a refusal.
//!
//! Invariants: the term is in milliseconds (the picker converts it into its own unit); it is 0
//! for a request without an adapter or with the feature off; an engine's [`AdapterSlots`] are
//! replaced whole on each scrape, never edited in place.

use std::sync::Arc;

/// The adapters an engine reported at its last scrape.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AdapterSlots {
    /// Adapters in GPU slots with running requests.
    pub running: Vec<Arc<str>>,
    /// Adapters of requests waiting in the engine's queue (being loaded, or waiting for a slot).
    pub waiting: Vec<Arc<str>>,
    /// GPU adapter slots (`--max-loras`); 0: unknown (a free slot is assumed).
    pub max_lora: u32,
    /// From the engine's metadata (the adapters it was started with), not its metrics: a scrape
    /// without the metric leaves these in place.
    pub from_metadata: bool,
}

impl AdapterSlots {
    /// Whether `adapter` is running or waiting there.
    pub fn holds(&self, adapter: &str) -> bool {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .any(|a| &**a == adapter)
    }
}

/// The last distinct adapters routed to one engine, most recent first, at most its slot count
/// (replaced whole on each change: picks read it without a lock).
#[derive(Debug, Default)]
pub struct RecentAdapters(arc_swap::ArcSwap<Vec<Arc<str>>>);

impl RecentAdapters {
    /// The adapters, most recent first.
    pub fn load(&self) -> arc_swap::Guard<Arc<Vec<Arc<str>>>> {
        self.0.load()
    }

    /// A request for `adapter` was routed here; keeps the last `cap` distinct ones (no write when
    /// it is the most recent already: the common case of a popular adapter).
    pub fn note(&self, adapter: &str, cap: usize) {
        if self.0.load().first().is_some_and(|a| &**a == adapter) {
            return;
        }
        let name: Arc<str> = adapter.into();
        self.0.rcu(|cur| {
            let mut next = Vec::with_capacity(cap.max(1));
            next.push(name.clone());
            next.extend(cur.iter().filter(|a| **a != name).cloned());
            next.truncate(cap.max(1));
            next
        });
    }
}

/// How a candidate fits a request's adapter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterFit {
    /// Running or waiting there: no load.
    Loaded,
    /// Not there, a slot free: one load.
    FreeSlot,
    /// Not there, every slot taken: a load and an eviction.
    Evicts,
    /// Saturated, holding the adapter or with a slot free: its advantage is lost (costed as an
    /// eviction). A saturated engine that would have to evict is [`Self::Evicts`].
    Saturated,
    /// The engine reports no adapters: no preference.
    Unknown,
}

impl AdapterFit {
    pub fn as_str(self) -> &'static str {
        match self {
            AdapterFit::Loaded => "loaded",
            AdapterFit::FreeSlot => "free_slot",
            AdapterFit::Evicts => "evicts",
            AdapterFit::Saturated => "saturated",
            AdapterFit::Unknown => "unknown",
        }
    }
}

/// `adapter_affinity` in the configuration: whether picks prefer engines that hold the request's
/// adapter, and what loading and evicting one cost.
#[derive(
    Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterAffinity {
    /// On by default: an operator who serves adapters expects requests to go where they are.
    pub enabled: bool,
    /// What loading an adapter into a free GPU slot adds to a request's time to first token.
    /// 100 ms: vLLM reads a rank-8 to rank-64 adapter of a 7-8B model (20-160 MB of safetensors)
    /// from disk or its CPU cache and copies it to the GPU in tens to a few hundred ms.
    pub load_cost_ms: f64,
    /// What evicting another adapter adds on top of the load: 200 ms. The request waits for the
    /// evicted adapter's running requests to drain its slot, and that adapter's next requests pay
    /// a load of their own.
    pub evict_cost_ms: f64,
}

impl Default for AdapterAffinity {
    fn default() -> Self {
        AdapterAffinity {
            enabled: true,
            load_cost_ms: 100.0,
            evict_cost_ms: 200.0,
        }
    }
}

impl AdapterAffinity {
    /// Every bad knob: `(name, message)`.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        [
            ("load_cost_ms", self.load_cost_ms),
            ("evict_cost_ms", self.evict_cost_ms),
        ]
        .into_iter()
        .filter(|(_, v)| !(v.is_finite() && *v >= 0.0))
        .map(|(name, v)| {
            (
                name,
                format!("{v} must be a finite number ≥ 0 (milliseconds)"),
            )
        })
        .collect()
    }

    /// How an engine reporting `slots` (None: unknown), last sent the adapters `recent`, fits
    /// `adapter`: its slots hold what runs there and what it was sent last.
    pub fn fit(
        slots: Option<&AdapterSlots>,
        recent: &[Arc<str>],
        adapter: &str,
        saturated: bool,
    ) -> AdapterFit {
        let Some(s) = slots else {
            return AdapterFit::Unknown;
        };
        // The slots hold what runs there, then the most recently sent idle adapters in the
        // slots left (vLLM evicts the least recently used idle one): an adapter sent there
        // recently but pushed out by adapters that run there since is not loaded.
        let idle: Vec<&Arc<str>> = recent.iter().filter(|r| !s.running.contains(r)).collect();
        let idle_slots = (s.max_lora as usize).saturating_sub(s.running.len());
        let idle_loaded = |k: usize| s.max_lora == 0 || k < idle_slots;
        let fit = if s.holds(adapter)
            || idle
                .iter()
                .position(|r| &***r == adapter)
                .is_some_and(idle_loaded)
        {
            AdapterFit::Loaded
        } else if s.max_lora == 0 || s.running.len() + idle.len() < s.max_lora as usize {
            AdapterFit::FreeSlot
        } else {
            AdapterFit::Evicts
        };
        match fit {
            AdapterFit::Loaded | AdapterFit::FreeSlot if saturated => AdapterFit::Saturated,
            fit => fit,
        }
    }

    /// The fit's cost in milliseconds.
    pub fn cost_ms(&self, fit: AdapterFit) -> f64 {
        match fit {
            AdapterFit::Loaded | AdapterFit::Unknown => 0.0,
            AdapterFit::FreeSlot => self.load_cost_ms,
            AdapterFit::Saturated => self.evict_cost_ms.max(self.load_cost_ms),
            AdapterFit::Evicts => self.load_cost_ms + self.evict_cost_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(running: &[&str], waiting: &[&str], max_lora: u32) -> AdapterSlots {
        AdapterSlots {
            running: running.iter().map(|&a| a.into()).collect(),
            waiting: waiting.iter().map(|&a| a.into()).collect(),
            max_lora,
            from_metadata: false,
        }
    }

    #[test]
    fn loaded_before_free_slot_before_eviction_and_saturation_loses_the_advantage() {
        let s = AdapterAffinity::default();
        let full = slots(&["a", "b"], &[], 2);
        let spare = slots(&["b"], &["c"], 2);
        let fit =
            |s: Option<&AdapterSlots>, a: &str, sat: bool| AdapterAffinity::fit(s, &[], a, sat);
        assert_eq!(fit(Some(&full), "a", false), AdapterFit::Loaded);
        assert_eq!(fit(Some(&spare), "c", false), AdapterFit::Loaded, "waiting");
        assert_eq!(fit(Some(&spare), "a", false), AdapterFit::FreeSlot);
        assert_eq!(fit(Some(&full), "c", false), AdapterFit::Evicts);
        assert_eq!(fit(Some(&full), "a", true), AdapterFit::Saturated);
        assert_eq!(
            fit(Some(&spare), "a", true),
            AdapterFit::Saturated,
            "a slot free"
        );
        assert_eq!(
            fit(Some(&full), "c", true),
            AdapterFit::Evicts,
            "saturated, must evict"
        );
        assert_eq!(fit(None, "a", false), AdapterFit::Unknown);
        assert_eq!(
            fit(Some(&slots(&["x"; 3], &[], 0)), "a", false),
            AdapterFit::FreeSlot
        );
        // What was routed there last is loaded (idle between requests, which vLLM does not
        // report), and takes a slot.
        let recent: Vec<Arc<str>> = vec!["r".into()];
        let idle = slots(&["b"], &[], 2);
        let with = |a: &str| AdapterAffinity::fit(Some(&idle), &recent, a, false);
        assert_eq!(
            (with("r"), with("z")),
            (AdapterFit::Loaded, AdapterFit::Evicts)
        );
        assert_eq!(fit(Some(&idle), "z", false), AdapterFit::FreeSlot);
        // One slot, another adapter running there since: what was sent there last was evicted.
        let one = slots(&["b"], &["b"], 1);
        assert_eq!(
            AdapterAffinity::fit(Some(&one), &recent, "r", false),
            AdapterFit::Evicts,
            "pushed out by the running adapter"
        );
        let two = slots(&["b"], &[], 2);
        assert_eq!(
            AdapterAffinity::fit(Some(&two), &recent, "r", false),
            AdapterFit::Loaded,
            "a second slot keeps it"
        );
        let order =
            [AdapterFit::Loaded, AdapterFit::FreeSlot, AdapterFit::Evicts].map(|f| s.cost_ms(f));
        assert!(order[0] < order[1] && order[1] < order[2], "{order:?}");
        // A saturated engine costs an eviction: more than a free slot elsewhere, less than
        // loading the adapter and evicting another.
        let saturated = s.cost_ms(AdapterFit::Saturated);
        assert!(
            order[1] < saturated && saturated < order[2],
            "{saturated} {order:?}"
        );
        assert_eq!(s.cost_ms(AdapterFit::Unknown), 0.0);
    }

    #[test]
    fn recent_adapters_keep_the_last_distinct_ones() {
        let r = RecentAdapters::default();
        for a in ["a", "b", "a", "c", "d"] {
            r.note(a, 3);
        }
        let held = r.load();
        let got: Vec<&str> = held.iter().map(|a| &**a).collect();
        assert_eq!(got, ["d", "c", "a"]);
    }

    #[test]
    fn bad_costs_are_named() {
        let bad = AdapterAffinity {
            load_cost_ms: -1.0,
            evict_cost_ms: f64::NAN,
            ..AdapterAffinity::default()
        };
        let names: Vec<_> = bad.validate().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["load_cost_ms", "evict_cost_ms"]);
        assert!(AdapterAffinity::default().validate().is_empty());
    }
}
