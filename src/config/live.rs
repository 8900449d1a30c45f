//! The configuration `kvepp serve` runs with now, its version, and which of its fields a reload
//! may change.
//!
//! Invariants: the effective tree only ever holds a validated configuration; its version starts
//! at 1 and grows by one with each applied reload. [`merge`] is the one place that says which
//! fields change live: everything else keeps its value from the start, and a reload that changes
//! such a field names it (the caller warns).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::Config;

/// The effective configuration and its version (`/debug/config`).
#[derive(Debug)]
pub struct Effective {
    current: ArcSwap<Config>,
    version: AtomicU64,
}

impl Effective {
    /// The configuration the process started with: version 1.
    pub(crate) fn new(cfg: Config) -> Self {
        Effective {
            current: ArcSwap::from_pointee(cfg),
            version: AtomicU64::new(1),
        }
    }

    /// The version and the configuration in effect.
    pub(crate) fn get(&self) -> (u64, Arc<Config>) {
        // Read the tree first: a concurrent reload stores it before bumping the version.
        let cfg = self.current.load_full();
        (self.version.load(Ordering::Acquire), cfg)
    }

    /// Puts `cfg` in effect; its version.
    pub(crate) fn replace(&self, cfg: Config) -> u64 {
        self.current.store(Arc::new(cfg));
        self.version.fetch_add(1, Ordering::AcqRel) + 1
    }
}

/// The tree that results from reloading `new` over `running`: the fields that change live come
/// from `new`, every other keeps its running value. Also returns the names of the fields `new`
/// changes that only a restart applies (dotted for a nested field).
pub(crate) fn merge(running: &Config, new: &Config) -> (Config, Vec<String>) {
    let mut out = running.clone();
    out.router = new.router;
    out.max_in_flight_per_endpoint = new.max_in_flight_per_endpoint;
    out.flow_control = new.flow_control.clone();
    out.rate_limits = new.rate_limits.clone();
    out.unknown_models = new.unknown_models;
    out.emit_endpoint_scores = new.emit_endpoint_scores;
    out.destination_endpoint_list = new.destination_endpoint_list;
    out.tokenizers = new.tokenizers.clone();
    out.log_level = new.log_level.clone();
    out.adapter_affinity = new.adapter_affinity;
    out.session_affinity = new.session_affinity.clone();
    // Engine scraping's period, limits and saturation thresholds; whether it runs at all is
    // decided at start.
    out.engine_metrics = crate::config::EngineMetricsConfig {
        enabled: running.engine_metrics.enabled,
        ..new.engine_metrics.clone()
    };
    let restart = changed(&out, new);
    (out, restart)
}

/// The fields (dotted below the top level) where `a` and `b` differ.
pub(crate) fn changed(a: &Config, b: &Config) -> Vec<String> {
    let (Ok(a), Ok(b)) = (serde_json::to_value(a), serde_json::to_value(b)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    differing("", &a, &b, &mut out);
    out
}

fn differing(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
    match (a, b) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                let name = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                let null = serde_json::Value::Null;
                differing(
                    &name,
                    a.get(k).unwrap_or(&null),
                    b.get(k).unwrap_or(&null),
                    out,
                );
            }
        }
        _ if a != b => out.push(prefix.to_owned()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_fields_change_and_the_others_are_named_and_kept() {
        let running = Config::default();
        let mut new = Config::default();
        new.router.temperature = 0.5;
        new.unknown_models = crate::config::UnknownModels::PassThrough;
        new.flow_control.max_queue_per_priority = 7;
        new.engine_metrics.interval_ms = 50;
        new.engine_metrics.enabled = false;
        new.grpc_port = 1;
        new.grpc_tls.mode = crate::config::TlsMode::Off;
        let (merged, restart) = merge(&running, &new);
        assert_eq!(merged.router.temperature, 0.5);
        assert_eq!(merged.flow_control.max_queue_per_priority, 7);
        assert_eq!(merged.engine_metrics.interval_ms, 50);
        assert_eq!(
            merged.unknown_models,
            crate::config::UnknownModels::PassThrough
        );
        assert!(merged.engine_metrics.enabled);
        assert_eq!(merged.grpc_port, running.grpc_port);
        assert_eq!(
            restart,
            ["engine_metrics.enabled", "grpc_port", "grpc_tls.mode"]
        );
        // Nothing asked beyond the live fields: nothing named.
        let (_, none) = merge(&running, &merged);
        assert!(none.is_empty(), "{none:?}");
    }

    #[test]
    fn versions_grow_with_each_replacement() {
        let e = Effective::new(Config::default());
        assert_eq!(e.get().0, 1);
        let c = Config {
            log_level: "debug".into(),
            ..Config::default()
        };
        assert_eq!(e.replace(c), 2);
        let (v, cfg) = e.get();
        assert_eq!((v, cfg.log_level.as_str()), (2, "debug"));
    }
}
