//! Affinity as the ext_proc door sees it: the session header read from the request, and the
//! counters of what sessions and adapters did to picks. Binding and choosing are the core's
//! (`kvepp_core::affinity`); this module only reads, reports and counts.
//!
//! Invariants: a session id that cannot be used (too long, not UTF-8, empty) is ignored with a
//! warning and a count, never an error for the request; the counters are registered by this
//! component itself.

use std::sync::Arc;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::metrics::{OutcomeLabels, ReasonLabels, Register};
use kvepp_core::affinity::{AdapterFit, SessionKey, SessionOutcome};
use kvepp_core::Router;

/// Where a request's session id comes from, and the counters of session and adapter affinity.
#[derive(Debug)]
pub struct Affinity {
    /// The session header (lower case); None: session affinity off. Replaced on a reload.
    header: arc_swap::ArcSwapOption<String>,
    /// `kvepp_session_affinity_total{outcome=hit|moved|new}`.
    outcomes: Family<OutcomeLabels, Counter>,
    /// `kvepp_session_ids_ignored_total{reason}`.
    ignored: Family<ReasonLabels, Counter>,
    /// `kvepp_adapter_picks_total{outcome}`: how the chosen endpoint fit the request's adapter.
    adapter_fits: Family<OutcomeLabels, Counter>,
    /// The router whose session table the gauges read at each scrape.
    router: Option<Arc<Router>>,
}

impl Default for Affinity {
    fn default() -> Self {
        Affinity::new(None, None)
    }
}

impl Affinity {
    /// Reads the session from `header` (None or empty: off); reports `router`'s table.
    pub(crate) fn new(header: Option<&str>, router: Option<Arc<Router>>) -> Self {
        Affinity {
            header: arc_swap::ArcSwapOption::new(Self::name(header)),
            outcomes: Family::default(),
            ignored: Family::default(),
            adapter_fits: Family::default(),
            router,
        }
    }

    fn name(header: Option<&str>) -> Option<Arc<String>> {
        header
            .filter(|h| !h.is_empty())
            .map(|h| Arc::new(h.to_ascii_lowercase()))
    }

    /// The session header's name, when session affinity is on.
    pub(crate) fn header(&self) -> Option<Arc<String>> {
        self.header.load_full()
    }

    /// Live reconfiguration: streams that start afterwards read `header` (None or empty: off).
    pub(crate) fn set_header(&self, header: Option<&str>) {
        self.header.store(Self::name(header));
    }

    /// The session of a request whose session header had `raw`; an unusable id is ignored,
    /// logged and counted.
    pub(crate) fn session(&self, raw: &[u8]) -> Option<SessionKey> {
        match SessionKey::parse(raw) {
            Ok(k) => Some(k),
            Err(e) => {
                tracing::warn!(header = self.header().as_deref().map(String::as_str), error = %e, "session id ignored; the request is routed without a session");
                self.ignored
                    .get_or_create(&ReasonLabels { reason: e.as_str() })
                    .inc();
                None
            }
        }
    }

    /// Counts what a routed request's session and adapter came to.
    pub fn count(&self, session: Option<SessionOutcome>, adapter: Option<AdapterFit>) {
        if let Some(s) = session {
            self.outcomes
                .get_or_create(&OutcomeLabels {
                    outcome: s.as_str(),
                })
                .inc();
        }
        if let Some(a) = adapter {
            self.adapter_fits
                .get_or_create(&OutcomeLabels {
                    outcome: a.as_str(),
                })
                .inc();
        }
    }
}

/// The session table's size and evictions, read at each scrape.
#[derive(Debug)]
struct SessionTable(Arc<Router>);

impl prometheus_client::collector::Collector for SessionTable {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = self.0.sessions();
        let evicted = ConstCounter::new(s.evictions());
        evicted.encode(encoder.encode_descriptor(
            "session_evictions",
            "Live session bindings dropped because the table was full (session_affinity.max_sessions)",
            None,
            evicted.metric_type(),
        )?)?;
        let held = ConstGauge::new(s.len() as i64);
        held.encode(encoder.encode_descriptor(
            "sessions",
            "Session bindings held (expired ones until looked up or pushed out)",
            None,
            held.metric_type(),
        )?)
    }
}

impl Register for Affinity {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "session_affinity",
            "Requests with a session by outcome: hit (its bound endpoint), moved (bound endpoint gone, ineligible or saturated), new",
            self.outcomes.clone(),
        );
        registry.register(
            "session_ids_ignored",
            "Session ids ignored (too_long: over 256 bytes, not_utf8, empty); the requests were routed without a session",
            self.ignored.clone(),
        );
        registry.register(
            "adapter_picks",
            "Picks of requests for a LoRA adapter by how the chosen endpoint fit it (loaded, free_slot, evicts, saturated, unknown)",
            self.adapter_fits.clone(),
        );
        if let Some(r) = &self.router {
            registry.register_collector(Box::new(SessionTable(r.clone())));
        }
    }
}
