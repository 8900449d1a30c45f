//! Tenant rate limits: token buckets per fairness id (the tenant), for requests per second and
//! prompt tokens per second, each with its burst, configured globally or per InferenceObjective.
//!
//! A request's tenant is its fairness header's value (`flow_control.fairness_header`); a request
//! without one is not limited (there is nobody to charge). Its limit is the one of the
//! InferenceObjective it names, when `rate_limits.objectives` has one, else `rate_limits.default`
//! (none: unlimited). A bucket is charged only when every bucket of the request has room, so a
//! refused request costs the tenant nothing; refused, it gets 429 with `retry-after` (whole
//! seconds until the buckets hold it again).
//!
//! Invariants:
//! - the bucket table holds at most `max_tenants` (tenant, limit) pairs; the least recently used is
//!   dropped beyond it (a dropped tenant starts again with full buckets). Each entry costs
//!   [`BYTES_PER_TENANT`] plus the lengths of its tenant id and objective name (about 2.3 MB for
//!   the default 10,000 tenants with 16-byte ids);
//! - with replicas, each enforces its share: the configured rates and bursts divided by the
//!   replicas it knows (itself and its replica-sync peers), as Envoy spreads a tenant's streams
//!   over them. The limit holds in total while the spread is even; nothing is exchanged per
//!   request;
//! - a reload replaces the limits; buckets of an unchanged limit keep their level.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::metrics::{BoundedLabels, Register, TenantLabels};
use crate::routing::Rejection;

/// Memory of one bucket-table entry besides the bytes of its tenant id and objective name: the
/// key's two `Arc<str>` (pointers and the two allocations' counts), the two buckets, the limit
/// they were filled for, the LRU list node's links and the hash table's slot (checked against
/// `size_of` in the tests).
pub const BYTES_PER_TENANT: usize = 200;

/// Tenants named in `kvepp_rate_limited_requests_total`; the others are counted as `other`.
pub const MAX_TENANT_LABELS: usize = 64;

/// One limit: requests and prompt tokens per second, each with a burst (what a tenant idle long
/// enough may send at once). An unset rate does not limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantLimit {
    /// Requests per second; unset: not limited.
    pub requests_per_second: Option<f64>,
    /// Default: the rate, at least 1.
    pub request_burst: Option<f64>,
    /// Prompt tokens per second; unset: not limited.
    pub prompt_tokens_per_second: Option<f64>,
    /// Default: the rate.
    pub prompt_token_burst: Option<f64>,
}

/// `rate_limits` in the configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RateLimitSettings {
    /// Every tenant's limit, for requests whose InferenceObjective has none of its own; unset:
    /// unlimited.
    pub default: Option<TenantLimit>,
    /// Limits by InferenceObjective name.
    pub objectives: BTreeMap<String, TenantLimit>,
    /// (tenant, limit) buckets kept; the least recently used is dropped beyond it.
    pub max_tenants: usize,
}

impl Default for RateLimitSettings {
    fn default() -> Self {
        RateLimitSettings {
            default: None,
            objectives: BTreeMap::new(),
            max_tenants: 10_000,
        }
    }
}

impl TenantLimit {
    fn problems(&self, at: &str, out: &mut Vec<String>) {
        for (field, v) in [
            ("requests_per_second", self.requests_per_second),
            ("request_burst", self.request_burst),
            ("prompt_tokens_per_second", self.prompt_tokens_per_second),
            ("prompt_token_burst", self.prompt_token_burst),
        ] {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v > 0.0)) {
                out.push(format!("{at}.{field} {v} must be a number above 0"));
            }
        }
        for (burst, set, rate) in [
            (
                "request_burst",
                self.request_burst,
                self.requests_per_second,
            ),
            (
                "prompt_token_burst",
                self.prompt_token_burst,
                self.prompt_tokens_per_second,
            ),
        ] {
            if set.is_some() && rate.is_none() {
                out.push(format!("{at}.{burst} is set without its rate"));
            }
        }
    }

    /// (rate, burst) of the request bucket and of the prompt-token bucket.
    fn buckets(&self) -> [Option<(f64, f64)>; 2] {
        [
            self.requests_per_second
                .map(|r| (r, self.request_burst.unwrap_or(r.max(1.0)))),
            self.prompt_tokens_per_second
                .map(|r| (r, self.prompt_token_burst.unwrap_or(r))),
        ]
    }
}

impl RateLimitSettings {
    /// One message per bad field.
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(d) = &self.default {
            d.problems("default", &mut out);
        }
        for (name, l) in &self.objectives {
            l.problems(&format!("objectives.{name}"), &mut out);
        }
        if !(1..=10_000_000).contains(&self.max_tenants) {
            out.push(format!(
                "max_tenants {} must be between 1 and 10000000",
                self.max_tenants
            ));
        }
        out
    }

    fn limit_for(&self, objective: Option<&str>) -> Option<(&str, &TenantLimit)> {
        objective
            .and_then(|o| self.objectives.get_key_value(o))
            .map(|(k, l)| (k.as_str(), l))
            .or_else(|| self.default.as_ref().map(|l| ("", l)))
    }
}

/// One token bucket: its level and when it was last filled.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    /// The level now, at `rate` per second up to `burst`.
    fn level(&self, rate: f64, burst: f64, now: Instant) -> f64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        (self.level + dt * rate).min(burst)
    }
}

/// A tenant's buckets for one limit.
#[derive(Debug)]
struct Entry {
    /// The limit (rates and bursts, already divided by the replicas) they were filled for.
    limit: [Option<(f64, f64)>; 2],
    buckets: [Bucket; 2],
}

/// (limit name: the objective, or "" for the default; tenant).
type Key = (Arc<str>, Arc<str>);

/// The rate limiter the ext_proc door asks before routing a request.
#[derive(Debug)]
pub struct RateLimiter {
    settings: arc_swap::ArcSwap<RateLimitSettings>,
    table: Mutex<lru::LruCache<Key, Entry>>,
    /// Replicas sharing the limits (this one and its replica-sync peers).
    replicas: AtomicUsize,
    metrics: RateLimitMetrics,
    labelled: BoundedLabels,
}

/// Rate limits' counters.
#[derive(Debug, Clone, Default)]
pub struct RateLimitMetrics {
    /// Requests refused, by tenant (the first [`MAX_TENANT_LABELS`] tenants refused; then `other`).
    pub limited: Family<TenantLabels, Counter>,
    /// (tenant, limit) buckets held now.
    pub tenants: Gauge,
}

impl Register for RateLimitMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "rate_limited_requests",
            "Requests answered 429 for exceeding their tenant's rate limit, by tenant (the first 64 tenants refused by name, the rest as other)",
            self.limited.clone(),
        );
        registry.register(
            "rate_limit_tenants",
            "Tenant buckets the rate limiter holds (bounded by rate_limits.max_tenants)",
            self.tenants.clone(),
        );
    }
}

fn capacity(n: usize) -> NonZeroUsize {
    NonZeroUsize::new(n).unwrap_or(NonZeroUsize::MIN)
}

impl RateLimiter {
    pub fn new(settings: RateLimitSettings, metrics: RateLimitMetrics) -> Self {
        RateLimiter {
            table: Mutex::new(lru::LruCache::new(capacity(settings.max_tenants))),
            settings: arc_swap::ArcSwap::from_pointee(settings),
            replicas: AtomicUsize::new(1),
            metrics,
            labelled: BoundedLabels::new(MAX_TENANT_LABELS),
        }
    }

    /// Live reconfiguration: later requests are checked against `settings`.
    pub(crate) fn reconfigure(&self, settings: RateLimitSettings) {
        let mut table = self.table.lock();
        table.resize(capacity(settings.max_tenants));
        self.metrics.tenants.set(table.len() as i64);
        self.settings.store(Arc::new(settings));
    }

    /// Sets how many replicas share the limits (at least 1: this one).
    pub(crate) fn set_replicas(&self, n: usize) {
        self.replicas.store(n.max(1), Ordering::Relaxed);
    }

    /// Charges one request of `prompt_tokens` to `tenant` under the limit of `objective`; a
    /// [`Rejection`] (429, `retry-after`) when its buckets cannot hold it now.
    pub fn check(
        &self,
        tenant: Option<&str>,
        objective: Option<&str>,
        prompt_tokens: u64,
        now: Instant,
    ) -> Result<(), Rejection> {
        let Some(tenant) = tenant else { return Ok(()) };
        let settings = self.settings.load();
        let Some((limit_name, limit)) = settings.limit_for(objective) else {
            return Ok(());
        };
        let share = self.replicas.load(Ordering::Relaxed) as f64;
        let limit = limit
            .buckets()
            .map(|b| b.map(|(rate, burst)| (rate / share, burst / share)));
        let cost = [1.0, prompt_tokens as f64];
        let mut table = self.table.lock();
        let key: Key = (limit_name.into(), tenant.into());
        let entry = table.get_or_insert_mut(key, || Entry {
            limit,
            buckets: std::array::from_fn(|i| Bucket {
                level: limit[i].map_or(0.0, |(_, burst)| burst),
                at: now,
            }),
        });
        if entry.limit != limit {
            // A reload or a replica change: the level carries over, capped by the new burst.
            for (b, l) in entry.buckets.iter_mut().zip(limit) {
                if let Some((_, burst)) = l {
                    b.level = b.level.min(burst);
                }
            }
            entry.limit = limit;
        }
        // Each bucket needs the request's cost, or a full bucket for a request larger than one;
        // the wait is for the emptiest bucket to get there.
        let mut levels = [0.0; 2];
        let mut wait_s: f64 = 0.0;
        let mut fits = true;
        for i in 0..2 {
            let Some((rate, burst)) = limit[i] else {
                continue;
            };
            levels[i] = entry.buckets[i].level(rate, burst, now);
            let need = cost[i].min(burst);
            if levels[i] < need {
                fits = false;
                wait_s = wait_s.max((need - levels[i]) / rate);
            }
        }
        if fits {
            for i in 0..2 {
                if limit[i].is_some() {
                    entry.buckets[i] = Bucket {
                        level: (levels[i] - cost[i]).max(0.0),
                        at: now,
                    };
                }
            }
            self.metrics.tenants.set(table.len() as i64);
            return Ok(());
        }
        self.metrics.tenants.set(table.len() as i64);
        drop(table);
        self.count(tenant);
        let retry_after = wait_s.ceil().max(1.0) as u64;
        let what = if limit_name.is_empty() {
            "rate_limits.default".to_owned()
        } else {
            format!("rate_limits.objectives.{limit_name}")
        };
        let mut r = Rejection::new(
            429,
            "rate_limited",
            format!(
                "tenant {tenant:?} is over its rate limit ({what}); retry after {retry_after} s"
            ),
        );
        r.retry_after_s = Some(retry_after);
        Err(r)
    }

    fn count(&self, tenant: &str) {
        let label = self.labelled.label(tenant);
        self.metrics
            .limited
            .get_or_create(&TenantLabels { tenant: label })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limiter(default: TenantLimit, max_tenants: usize) -> RateLimiter {
        RateLimiter::new(
            RateLimitSettings {
                default: Some(default),
                objectives: BTreeMap::from([(
                    "batch".to_owned(),
                    TenantLimit {
                        requests_per_second: Some(100.0),
                        ..TenantLimit::default()
                    },
                )]),
                max_tenants,
            },
            RateLimitMetrics::default(),
        )
    }

    fn two_per_second() -> TenantLimit {
        TenantLimit {
            requests_per_second: Some(2.0),
            request_burst: Some(2.0),
            ..TenantLimit::default()
        }
    }

    #[test]
    fn a_burst_passes_then_429_with_retry_after_then_the_rate_refills() {
        let l = limiter(two_per_second(), 100);
        let t0 = Instant::now();
        assert!(l.check(Some("a"), None, 0, t0).is_ok());
        assert!(l.check(Some("a"), None, 0, t0).is_ok());
        let r = l.check(Some("a"), None, 0, t0).unwrap_err();
        assert_eq!(
            (r.status, r.reason, r.retry_after_s),
            (429, "rate_limited", Some(1))
        );
        // Other tenants, requests without a tenant, and another objective's limit: unaffected.
        assert!(l.check(Some("b"), None, 0, t0).is_ok());
        assert!(l.check(None, None, 0, t0).is_ok());
        assert!(l.check(Some("a"), Some("batch"), 0, t0).is_ok());
        // Half a second refills one request.
        let t1 = t0 + Duration::from_millis(500);
        assert!(l.check(Some("a"), None, 0, t1).is_ok());
        assert!(l.check(Some("a"), None, 0, t1).is_err());
        let counted = l
            .metrics
            .limited
            .get_or_create(&TenantLabels { tenant: "a".into() })
            .get();
        assert_eq!(counted, 2);
    }

    #[test]
    fn prompt_tokens_are_charged_and_a_refused_request_costs_nothing() {
        let l = limiter(
            TenantLimit {
                requests_per_second: Some(1000.0),
                prompt_tokens_per_second: Some(100.0),
                prompt_token_burst: Some(1000.0),
                ..TenantLimit::default()
            },
            100,
        );
        let t0 = Instant::now();
        assert!(l.check(Some("a"), None, 800, t0).is_ok());
        let r = l.check(Some("a"), None, 400, t0).unwrap_err();
        assert_eq!(r.retry_after_s, Some(2), "200 tokens short at 100/s");
        assert!(
            l.check(Some("a"), None, 200, t0).is_ok(),
            "the refusal charged nothing"
        );
        // A prompt larger than the burst passes only on a full bucket.
        let t1 = t0 + Duration::from_secs(10);
        assert!(l.check(Some("a"), None, 5000, t1).is_ok());
        assert!(l.check(Some("a"), None, 1, t1).is_err());
    }

    #[test]
    fn the_table_is_bounded_and_replicas_share_the_limit() {
        let l = limiter(two_per_second(), 3);
        let t0 = Instant::now();
        for t in ["a", "b", "c", "d"] {
            assert!(l.check(Some(t), None, 0, t0).is_ok());
        }
        assert_eq!(l.table.lock().len(), 3);
        assert_eq!(l.metrics.tenants.get(), 3);
        // Two replicas: each allows half the burst.
        let l = limiter(two_per_second(), 100);
        l.set_replicas(2);
        assert!(l.check(Some("a"), None, 0, t0).is_ok());
        assert!(l.check(Some("a"), None, 0, t0).is_err());
    }

    #[test]
    fn an_entry_costs_what_the_doc_says() {
        let node = std::mem::size_of::<(Key, Entry)>() + 2 * std::mem::size_of::<usize>();
        let slot = 2 * std::mem::size_of::<usize>();
        let arc_counts = 2 * 2 * std::mem::size_of::<usize>();
        assert!(
            node + slot + arc_counts <= BYTES_PER_TENANT,
            "{node} + {slot} + {arc_counts} > {BYTES_PER_TENANT}"
        );
    }

    #[test]
    fn zero_negative_and_orphan_settings_are_refused() {
        let bad = RateLimitSettings {
            default: Some(TenantLimit {
                requests_per_second: Some(0.0),
                prompt_token_burst: Some(10.0),
                ..TenantLimit::default()
            }),
            objectives: BTreeMap::from([(
                "o".to_owned(),
                TenantLimit {
                    prompt_tokens_per_second: Some(-5.0),
                    ..TenantLimit::default()
                },
            )]),
            max_tenants: 0,
        };
        let p = bad.problems();
        assert_eq!(p.len(), 4, "{p:?}");
        assert!(p[0].contains("default.requests_per_second 0"), "{p:?}");
        assert!(RateLimitSettings::default().problems().is_empty());
    }
}
