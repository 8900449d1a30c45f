//! Validation of the configuration tree, one function per part of it: every bad field is
//! reported (one message each), nothing stops at the first.

use super::{is_dns_label, Config, PickerKind};

impl Config {
    /// The pool and how it is discovered.
    pub(super) fn pool_problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        if !is_dns_label(&self.pool_name) {
            bad("pool_name", format!("{:?} must be a Kubernetes object name (lowercase letters, digits, '-', '.'; required)", self.pool_name));
        }
        if !is_dns_label(&self.pool_namespace) {
            bad(
                "pool_namespace",
                format!(
                    "{:?} is not a Kubernetes namespace name",
                    self.pool_namespace
                ),
            );
        }
        if let Some(svc) = &self.endpoint_service {
            if !is_dns_label(svc) {
                bad(
                    "endpoint_service",
                    format!("{svc:?} is not a Kubernetes Service name"),
                );
            }
        }
        if let Some(svc) = &self.endpoint_picker_service {
            if !is_dns_label(svc) {
                bad(
                    "endpoint_picker_service",
                    format!("{svc:?} is not a Kubernetes Service name"),
                );
            }
        }
        if let Some(d) = self.manifests_dir.as_ref().filter(|d| !d.is_dir()) {
            bad(
                "manifests_dir",
                format!("{} is not a directory", d.display()),
            );
        }
        if let Some(k) = self.kubeconfig.as_ref().filter(|k| !k.is_file()) {
            bad("kubeconfig", format!("{} is not a file", k.display()));
        }
        if !(10..=60_000).contains(&self.manifests_poll_ms) {
            bad(
                "manifests_poll_ms",
                format!("{} must be between 10 and 60000", self.manifests_poll_ms),
            );
        }
    }

    /// The servers: ports, limits, TLS, replica sync and the HTTP doors.
    pub(super) fn server_problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        if self.max_body_bytes < 1024 || self.max_body_bytes > 256 << 20 {
            bad(
                "max_body_bytes",
                format!("{} must be between 1 KiB and 256 MiB", self.max_body_bytes),
            );
        }
        let ports = [
            ("grpc_port", self.grpc_port),
            ("grpc_health_port", self.grpc_health_port),
            ("metrics_port", self.metrics_port),
            ("select_service_port", self.select_service_port.unwrap_or(0)),
            ("slot_tracker_port", self.slot_tracker_port.unwrap_or(0)),
        ];
        for problem in self.grpc_tls.problems() {
            bad("grpc_tls", problem);
        }
        for problem in self.replica_sync.problems() {
            bad("replica_sync", problem);
        }
        if self.replica_sync.bind.is_some()
            && matches!(
                self.picker,
                PickerKind::LeastLoaded | PickerKind::RoundRobin
            )
        {
            bad(
                "replica_sync",
                "replica sync shares the KV-aware picker's bookings: it needs picker kv-aware or approximate-prefix".to_string(),
            );
        }
        let http_doors = self.select_service_port.is_some() || self.slot_tracker_port.is_some();
        if http_doors
            && matches!(
                self.picker,
                PickerKind::LeastLoaded | PickerKind::RoundRobin
            )
        {
            bad(
                "select_service_port",
                "the selection and slot-tracker services need a KV-aware picker (kv-aware or approximate-prefix)".to_string(),
            );
        }
        for (i, (name, port)) in ports.iter().enumerate() {
            if *port != 0 && ports[..i].iter().any(|(_, p)| p == port) {
                bad(
                    name,
                    format!("port {port} is already used by another server"),
                );
            }
        }
        if self.startup_wait_ms > 60_000 {
            bad(
                "startup_wait_ms",
                format!("{} must be at most 60000", self.startup_wait_ms),
            );
        }
    }

    /// Reading the engines: block size, metrics scraping, metadata, KV events.
    pub(super) fn engine_problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        if let Some(bs) = self.block_size.filter(|bs| !(1..=1024).contains(bs)) {
            bad(
                "block_size",
                format!("{bs} must be between 1 and 1024 tokens"),
            );
        }
        let em = &self.engine_metrics;
        if !(10..=60_000).contains(&em.interval_ms) {
            bad(
                "engine_metrics.interval_ms",
                format!("{} must be between 10 and 60000", em.interval_ms),
            );
        }
        if em.stale_after_ms < 2 * em.interval_ms {
            bad(
                "engine_metrics.stale_after_ms",
                format!(
                    "{} must be at least twice interval_ms ({})",
                    em.stale_after_ms, em.interval_ms
                ),
            );
        }
        if !(10..=60_000).contains(&em.timeout_ms) {
            bad(
                "engine_metrics.timeout_ms",
                format!("{} must be between 10 and 60000", em.timeout_ms),
            );
        }
        if em.max_page_bytes < 1024 {
            bad(
                "engine_metrics.max_page_bytes",
                format!("{} must be at least 1024", em.max_page_bytes),
            );
        }
        let md = &self.engine_metadata;
        if md.timeout_ms == 0 || md.refresh_ms == 0 || md.backoff_min_ms == 0 {
            bad(
                "engine_metadata",
                "refresh_ms, timeout_ms and backoff_min_ms must be above 0".into(),
            );
        }
        if em.kv_cache_threshold.is_nan() || em.kv_cache_threshold <= 0.0 {
            bad(
                "engine_metrics.kv_cache_threshold",
                format!("{} must be > 0 (≥ 1 disables)", em.kv_cache_threshold),
            );
        }
        if self.kv_events.enabled && self.kv_events.port == 0 {
            bad(
                "kv_events.port",
                "must not be 0 when KV events are enabled".into(),
            );
        }
    }

    /// Routing beyond the cost: flow control, disaggregation, tokenizers, approximate mode.
    pub(super) fn routing_problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        for p in self.flow_control.problems() {
            bad("flow_control", p);
        }
        for p in self.rate_limits.problems() {
            bad("rate_limits", p);
        }
        for (name, message) in self.disaggregation.validate() {
            bad("disaggregation", format!("{name}: {message}"));
        }
        for (model, dir) in &self.tokenizers {
            if !dir.join("tokenizer.json").is_file() {
                bad(
                    "tokenizers",
                    format!("{model}: {} has no tokenizer.json", dir.display()),
                );
            }
        }
        if self.approx_blocks_per_endpoint == 0 {
            bad("approx_blocks_per_endpoint", "must be at least 1".into());
        }
    }

    /// What every process of the tree reads: the cost knobs, the API token, the log filter.
    pub(super) fn shared_problems(&self, bad: &mut dyn FnMut(&'static str, String)) {
        for e in self.router.validate() {
            bad("router", format!("{}: {}", e.name, e.message));
        }
        for (name, message) in self.adapter_affinity.validate() {
            bad("adapter_affinity", format!("{name}: {message}"));
        }
        for (name, message) in self.session_affinity.validate() {
            bad("session_affinity", format!("{name}: {message}"));
        }
        if let Some(f) = &self.api_token_file {
            if let Err(e) = crate::api::auth::ApiToken::from_file(f) {
                bad("api_token_file", e.to_string());
            }
        }
        if tracing_subscriber::EnvFilter::try_new(&self.log_level).is_err() {
            bad(
                "log_level",
                format!("{:?} is not a valid log filter", self.log_level),
            );
        }
    }
}
