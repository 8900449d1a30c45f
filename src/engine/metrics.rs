//! The load signals a model server publishes on its Prometheus `/metrics`, scraped per endpoint at
//! an interval ([`run_scraper`]) into each endpoint's load ([`kvepp_core::EndpointLoad`]),
//! beside our own in-flight counters. The engine kind is told by the names on the page
//! ([`EngineKind`]); both kinds feed the same load and saturation model.
//!
//! - vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`
//!   (older vLLM: `vllm:gpu_cache_usage_perc`), and the labels `block_size` / `num_gpu_blocks` /
//!   `num_cpu_blocks` of `vllm:cache_config_info`.
//! - SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`, and the
//!   constants `sglang:page_size` (the block size) and `sglang:max_total_num_tokens` (the KV
//!   capacity: `max_total_num_tokens / page_size` blocks).
//!
//! Several series of one metric (per model name, per data-parallel rank) are summed (usage: the
//! largest; capacity: the largest rank's). A page with neither kind's load series is an error
//! ([`NotAnEngine`]): the endpoint is routed by kvepp's own in-flight counts alone, logged once
//! and counted. Such an endpoint (or one with no metrics page at all, as SGLang without
//! `--enable-metrics`) is asked once for SGLang's `GET /server_info`: an answer with a
//! `page_size` makes it an SGLang engine, whose page size and `max_total_num_tokens` give the
//! block size and the KV capacity ([`ServerInfo`]).
//!
//! `engine_metrics.engine` (`auto`, the default; `vllm`; `sglang`) fixes the kind instead: only
//! that engine's series are read, and a page without them is [`NotAnEngine`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use kvepp_core::Endpoint;
use kvepp_core::EngineMetrics;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("neither vLLM nor SGLang metrics on the page (vllm:num_requests_waiting / _running / kv_cache_usage_perc, sglang:num_queue_reqs / num_running_reqs / token_usage)")]
pub struct NotAnEngine;

/// Which model server a metrics page comes from.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Vllm,
    Sglang,
}

impl EngineKind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }

    /// The series whose `model_name` label names the served base model.
    fn running_series(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm:num_requests_running",
            EngineKind::Sglang => "sglang:num_running_reqs",
        }
    }
}

/// Splits one exposition line into (name, labels text, value).
fn sample(line: &str) -> Option<(&str, &str, f64)> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (series, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].find('}')?;
            (&line[..close + 1], &line[close + 1..])
        }
        None => line.split_at(line.find(char::is_whitespace)?),
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    let (name, labels) = match series.find('{') {
        Some(open) => (&series[..open], &series[open + 1..series.len() - 1]),
        None => (series, ""),
    };
    Some((name, labels, value))
}

/// Which engine kind endpoints are (`engine_metrics.engine`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum EngineSelect {
    /// Told per endpoint by its metrics page (or `/server_info`).
    #[default]
    Auto,
    Vllm,
    Sglang,
}

impl EngineSelect {
    /// The kind every endpoint is; None: detected.
    pub(crate) fn fixed(self) -> Option<EngineKind> {
        match self {
            EngineSelect::Auto => None,
            EngineSelect::Vllm => Some(EngineKind::Vllm),
            EngineSelect::Sglang => Some(EngineKind::Sglang),
        }
    }
}

/// What SGLang's `GET /server_info` tells a router: its page size (tokens per KV block) and its
/// KV capacity in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct ServerInfo {
    pub page_size: u32,
    #[serde(default)]
    pub max_total_num_tokens: Option<u64>,
}

impl ServerInfo {
    /// An SGLang `/server_info` answer; None for anything else (no positive `page_size`).
    pub(crate) fn parse(body: &[u8]) -> Option<ServerInfo> {
        serde_json::from_slice::<ServerInfo>(body)
            .ok()
            .filter(|i| i.page_size > 0)
    }

    /// KV capacity in blocks (pages).
    pub(crate) fn capacity_blocks(&self) -> Option<u64> {
        self.max_total_num_tokens
            .map(|t| t / u64::from(self.page_size))
    }
}

/// The load signals of a vLLM or SGLang metrics page, and which of the two it is (the first
/// load series on the page decides; a page mixing both is read as that one).
#[cfg(test)]
pub(crate) fn parse(page: &str) -> Result<(EngineKind, EngineMetrics), NotAnEngine> {
    parse_as(page, None)
}

/// The load signals of a vLLM or SGLang metrics page and which of the two it is, as `parse`
/// reads them, reading only `only`'s series when given.
pub(crate) fn parse_as(
    page: &str,
    only: Option<EngineKind>,
) -> Result<(EngineKind, EngineMetrics), NotAnEngine> {
    let mut m = EngineMetrics::default();
    let mut kind = None;
    let (mut sglang_tokens, mut sglang_page) = (None::<f64>, None::<f64>);
    for (name, labels, value) in page.lines().filter_map(sample) {
        if !value.is_finite() {
            continue;
        }
        // Under priority scheduling SGLang writes each queue's total with `priority=""` and its
        // breakdown with `priority="<n>"` beside it: the breakdown would count requests twice.
        if name.starts_with("sglang:")
            && super::exposition::label(labels, "priority").is_some_and(|p| !p.is_empty())
        {
            continue;
        }
        let of = |k: EngineKind| {
            name.starts_with(k.as_str()) && name.as_bytes().get(k.as_str().len()) == Some(&b':')
        };
        if only.is_some_and(|k| !of(k)) {
            continue;
        }
        let this = match name {
            "vllm:num_requests_waiting" => {
                m.waiting += value;
                EngineKind::Vllm
            }
            "vllm:num_requests_running" => {
                m.running += value;
                EngineKind::Vllm
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                m.kv_cache_usage = m.kv_cache_usage.max(value);
                EngineKind::Vllm
            }
            "vllm:cache_config_info" => {
                let label = |key| super::exposition::label(labels, key);
                m.block_size = label("block_size").and_then(|v| v.parse().ok());
                m.num_gpu_blocks = label("num_gpu_blocks").and_then(|v| v.parse().ok());
                m.num_cpu_blocks = label("num_cpu_blocks").and_then(|v| v.parse().ok());
                continue;
            }
            "sglang:num_queue_reqs" => {
                m.waiting += value;
                EngineKind::Sglang
            }
            "sglang:num_running_reqs" => {
                m.running += value;
                EngineKind::Sglang
            }
            "sglang:token_usage" => {
                m.kv_cache_usage = m.kv_cache_usage.max(value);
                EngineKind::Sglang
            }
            "sglang:page_size" => {
                sglang_page = Some(sglang_page.unwrap_or(0.0).max(value));
                continue;
            }
            "sglang:max_total_num_tokens" => {
                sglang_tokens = Some(sglang_tokens.unwrap_or(0.0).max(value));
                continue;
            }
            _ => continue,
        };
        kind.get_or_insert(this);
    }
    let kind = kind.ok_or(NotAnEngine)?;
    if kind == EngineKind::Sglang {
        // Only whole, positive sizes: a page size of 0 (or a fraction) is no block size.
        let page =
            sglang_page.filter(|p| *p >= 1.0 && p.fract() == 0.0 && *p <= f64::from(u32::MAX));
        m.block_size = page.map(|p| p as u32);
        m.num_gpu_blocks = match (sglang_tokens, page) {
            (Some(t), Some(p)) if t >= 0.0 => Some((t / p) as u64),
            _ => None,
        };
        m.num_cpu_blocks = None;
    }
    Ok((kind, m))
}

/// Scraping the engines' Prometheus `/metrics` (vLLM names) for load signals and saturation.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct EngineMetricsConfig {
    /// Scrape every ready endpoint's `/metrics`.
    pub enabled: bool,
    /// Time between scrapes of one endpoint, in milliseconds.
    pub interval_ms: u64,
    /// Metrics older than this make an engine count as saturated (Sheddable requests get 429
    /// when every candidate is).
    pub stale_after_ms: u64,
    /// `vllm:num_requests_waiting` at which an engine is saturated; 0 disables.
    pub queue_threshold: u32,
    /// `vllm:kv_cache_usage_perc` at which an engine is saturated.
    pub kv_cache_threshold: f64,
    /// Time allowed for one scrape.
    pub timeout_ms: u64,
    /// Largest `/metrics` page read; a larger one is a failed scrape.
    pub max_page_bytes: usize,
    /// Which engine the endpoints run: `auto` (told by each endpoint's metrics page, or its
    /// `/server_info`), `vllm` or `sglang` (only that engine's series are read).
    pub engine: EngineSelect,
}

impl Default for EngineMetricsConfig {
    fn default() -> Self {
        EngineMetricsConfig {
            enabled: true,
            interval_ms: 200,
            stale_after_ms: 2000,
            queue_threshold: 5,
            kv_cache_threshold: 0.8,
            timeout_ms: 200,
            max_page_bytes: 1 << 20,
            engine: EngineSelect::Auto,
        }
    }
}

/// How the scraper runs.
#[derive(Debug, Clone, Copy)]
pub struct ScrapeSettings {
    pub interval: Duration,
    pub timeout: Duration,
    /// Largest page read.
    pub max_bytes: usize,
    /// The configured engine kind; None: detected per endpoint.
    pub engine: Option<EngineKind>,
}

/// Scrapes every ready endpoint (the current value of `pool`, in the pool's `protocol`) each
/// `interval` (concurrently, each bounded by `timeout`; the current value of `live`, which a
/// reload may change) and records the result on the endpoint's
/// load: its queue and cache, and its LoRA adapters ([`super::lora`]). With the KV-aware state
/// `kv`: each `cache_config_info` block size is learned (when not configured), the base model from
/// the series' `model_name` label (any other model a request names is an adapter), and only the
/// requests the slot tracker does not hold on a worker (its own and replica peers' bookings)
/// count as hidden traffic.
pub(crate) async fn run_scraper(
    pool: watch::Receiver<Arc<[Arc<Endpoint>]>>,
    protocol: impl Fn() -> super::HttpVersion + Send + 'static,
    live: watch::Receiver<ScrapeSettings>,
    counters: super::EngineCounters,
    kv: Option<Arc<kvepp_core::KvState>>,
    shutdown: watch::Receiver<bool>,
) {
    let mut pace = crate::pace::Pace::new(live.borrow().interval, shutdown);
    let mut scrape_failures = FailureRuns::default();
    let mut lora_failures = FailureRuns::default();
    let mut kinds = Kinds::default();
    while pace.next().await {
        let settings = *live.borrow();
        pace.set_period(settings.interval);
        let endpoints = pool.borrow().clone();
        scrape_failures.retain(&endpoints);
        lora_failures.retain(&endpoints);
        kinds.retain(&endpoints, &counters);
        let mut scrapes = tokio::task::JoinSet::new();
        let version = protocol();
        for ep in endpoints.iter().cloned() {
            let probe = kinds.probe_due(&ep, settings.engine);
            scrapes.spawn(async move {
                let get = |path| {
                    super::get_with(version, ep.addr, path, settings.timeout, settings.max_bytes)
                };
                let page = get("/metrics").await;
                // An endpoint not yet known whose page tells no engine (or that has none).
                let unknown = match &page {
                    Ok(b) => parse_as(&String::from_utf8_lossy(b), settings.engine).is_err(),
                    Err(e) => !matches!(e, super::FetchError::Connect { .. }),
                };
                let info = if probe && unknown {
                    Some(
                        get("/server_info")
                            .await
                            .ok()
                            .and_then(|b| ServerInfo::parse(&b)),
                    )
                } else {
                    None
                };
                (ep, page, info)
            });
        }
        while let Some(done) = scrapes.join_next().await {
            let Ok((ep, page, info)) = done else { continue };
            if let Some(info) = info {
                kinds.probed(&ep, info, kv.as_deref(), &counters);
            }
            let result = page.map_err(|e| e.to_string()).and_then(|b| {
                let text = String::from_utf8_lossy(&b);
                let (kind, m) = parse_as(&text, settings.engine).map_err(|e| e.to_string())?;
                record_adapters(&ep, &text, &counters, &mut lora_failures);
                if let (Some(kv), Some(model)) = (&kv, base_model(&text, kind)) {
                    kv.learn_base_model(&model);
                }
                if let Some(r) = prefix_cache_hit_ratio(&text, kind) {
                    counters
                        .prefix_cache_hit_ratio
                        .get_or_create(&crate::metrics::EndpointLabels {
                            endpoint: ep.addr_str.clone(),
                        })
                        .set(r);
                }
                Ok((kind, m))
            });
            match result {
                Ok((kind, m)) => {
                    kinds.seen(&ep, kind, "metrics page", &counters);
                    if let (Some(kv), Some(bs)) = (&kv, m.block_size) {
                        kv.learn_block_size(ep.worker, bs);
                    }
                    if let (Some(kv), Some(gpu)) = (&kv, m.num_gpu_blocks) {
                        let blocks = gpu.saturating_add(m.num_cpu_blocks.unwrap_or(0));
                        kv.set_engine_capacity(ep.rank(), blocks);
                    }
                    let tracked = kv.as_ref().and_then(|kv| kv.worker_requests(ep.worker));
                    ep.load.engine_update_known(m, Instant::now(), tracked);
                    scrape_failures.ended(&ep);
                }
                Err(e) => {
                    counters.scrape_errors.inc();
                    scrape_failures.failed(&ep, "engine metrics scrape failed", &e);
                }
            }
        }
    }
}

/// The engine kind each endpoint showed (its metrics page, or `/server_info`): logged when first
/// seen or changed, exported as `engine_kind{endpoint, engine}` (1 for the kind seen last); and
/// which endpoints have been asked for `/server_info` (once each while they stay in the pool).
#[derive(Debug, Default)]
struct Kinds {
    seen: std::collections::HashMap<std::net::SocketAddr, (Arc<str>, EngineKind)>,
    probed: std::collections::HashSet<std::net::SocketAddr>,
}

impl Kinds {
    fn seen(
        &mut self,
        ep: &Endpoint,
        kind: EngineKind,
        from: &str,
        counters: &super::EngineCounters,
    ) {
        let old = self.seen.insert(ep.addr, (ep.addr_str.clone(), kind));
        if old.as_ref().map(|(_, k)| *k) == Some(kind) {
            return;
        }
        if let Some((_, k)) = old {
            counters.engine_kind.remove(&kind_labels(&ep.addr_str, k));
        }
        counters
            .engine_kind
            .get_or_create(&kind_labels(&ep.addr_str, kind))
            .set(1);
        tracing::info!(endpoint = %ep.addr_str, engine = kind.as_str(), from, "engine kind");
    }

    /// Whether `ep` is to be asked for `/server_info` if its page tells no engine: not yet
    /// asked, no kind seen, and SGLang not ruled out by the configuration.
    fn probe_due(&self, ep: &Endpoint, fixed: Option<EngineKind>) -> bool {
        fixed != Some(EngineKind::Vllm)
            && !self.seen.contains_key(&ep.addr)
            && !self.probed.contains(&ep.addr)
    }

    /// `ep` answered `/server_info` with `info` (None: not SGLang's answer): an SGLang engine
    /// whose page size is the block size and whose token capacity bounds its index.
    fn probed(
        &mut self,
        ep: &Endpoint,
        info: Option<ServerInfo>,
        kv: Option<&kvepp_core::KvState>,
        counters: &super::EngineCounters,
    ) {
        self.probed.insert(ep.addr);
        let Some(info) = info else {
            tracing::info!(endpoint = %ep.addr_str, "no engine metrics and no SGLang /server_info: routed by kvepp's own counts alone");
            return;
        };
        self.seen(ep, EngineKind::Sglang, "/server_info", counters);
        if let Some(kv) = kv {
            kv.learn_block_size(ep.worker, info.page_size);
            if let Some(blocks) = info.capacity_blocks() {
                kv.set_engine_capacity(ep.rank(), blocks);
            }
        }
    }

    /// Forgets endpoints no longer in the pool, and their gauge.
    fn retain(&mut self, endpoints: &[Arc<Endpoint>], counters: &super::EngineCounters) {
        let live = |addr: &std::net::SocketAddr| endpoints.iter().any(|e| e.addr == *addr);
        self.seen.retain(|addr, (name, kind)| {
            let keep = live(addr);
            if !keep {
                counters.engine_kind.remove(&kind_labels(name, *kind));
                counters
                    .prefix_cache_hit_ratio
                    .remove(&crate::metrics::EndpointLabels {
                        endpoint: name.clone(),
                    });
            }
            keep
        });
        self.probed.retain(live);
    }
}

fn kind_labels(endpoint: &Arc<str>, kind: EngineKind) -> super::EngineKindLabels {
    super::EngineKindLabels {
        endpoint: endpoint.clone(),
        engine: kind.as_str(),
    }
}

/// Endpoints in a run of failures of one kind: a run's first failure is logged at warn level, its
/// repeats at debug; a success ends the run.
#[derive(Debug, Default)]
struct FailureRuns(std::collections::HashSet<std::net::SocketAddr>);

impl FailureRuns {
    /// Forgets endpoints no longer in the pool.
    fn retain(&mut self, endpoints: &[Arc<Endpoint>]) {
        self.0.retain(|a| endpoints.iter().any(|e| e.addr == *a));
    }

    fn ended(&mut self, ep: &Endpoint) {
        self.0.remove(&ep.addr);
    }

    fn failed(&mut self, ep: &Endpoint, what: &str, error: &dyn std::fmt::Display) {
        if self.0.insert(ep.addr) {
            tracing::warn!(endpoint = %ep.addr_str, error = %error, "{what} (repeats logged at debug)");
        } else {
            tracing::debug!(endpoint = %ep.addr_str, error = %error, "{what}");
        }
    }
}

/// The endpoint's adapters from its page (none on the page: unknown); an unreadable
/// `vllm:lora_requests_info` keeps what was known, and is counted and logged.
fn record_adapters(
    ep: &Endpoint,
    page: &str,
    counters: &super::EngineCounters,
    failures: &mut FailureRuns,
) {
    match super::lora::parse(page) {
        Ok(slots) => {
            ep.load.set_adapters(slots);
            failures.ended(ep);
        }
        Err(e) => {
            counters.lora_info_malformed.inc();
            failures.failed(
                ep,
                "engine adapters not read; the last known ones are kept",
                &e,
            );
        }
    }
}

/// The served base model: the `model_name` label of the engine's running-requests series.
fn base_model(page: &str, kind: EngineKind) -> Option<String> {
    page.lines().find_map(|l| {
        let (set, _) = super::exposition::series(l.trim_start(), kind.running_series())?;
        super::exposition::label(set, "model_name").filter(|n| !n.is_empty())
    })
}

/// The engine's own prefix-cache hit ratio: vLLM's `vllm:prefix_cache_hits_total` ÷
/// `vllm:prefix_cache_queries_total` (since the engine started), SGLang's `sglang:cache_hit_rate`
/// (the mean over its ranks). None when the page has none (or vLLM has had no query yet).
pub(crate) fn prefix_cache_hit_ratio(page: &str, kind: EngineKind) -> Option<f64> {
    let (mut a, mut b, mut n) = (0.0, 0.0, 0u32);
    for (name, _, value) in page.lines().filter_map(sample) {
        if !value.is_finite() {
            continue;
        }
        match (kind, name) {
            (EngineKind::Vllm, "vllm:prefix_cache_hits_total") => a += value,
            (EngineKind::Vllm, "vllm:prefix_cache_queries_total") => b += value,
            (EngineKind::Sglang, "sglang:cache_hit_rate") => {
                a += value;
                n += 1;
            }
            _ => {}
        }
    }
    match kind {
        EngineKind::Vllm => (b > 0.0).then(|| (a / b).clamp(0.0, 1.0)),
        EngineKind::Sglang => (n > 0).then(|| (a / f64::from(n)).clamp(0.0, 1.0)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="24064",num_cpu_blocks="512",prefix_caching_hash_algo="sha256"} 1.0
vllm:other_total 99
"#;

    #[test]
    fn reads_the_vllm_series() {
        let (kind, m) = parse(PAGE).unwrap();
        assert_eq!(kind, EngineKind::Vllm);
        assert_eq!(
            m,
            EngineMetrics {
                waiting: 5.0,
                running: 7.0,
                kv_cache_usage: 0.42,
                block_size: Some(16),
                num_gpu_blocks: Some(24064),
                num_cpu_blocks: Some(512),
            }
        );
        // Older name, no labels at all.
        let (_, m) = parse("vllm:gpu_cache_usage_perc 0.9\nvllm:num_requests_running 1\n").unwrap();
        assert_eq!(
            (m.kv_cache_usage, m.running, m.block_size),
            (0.9, 1.0, None)
        );
    }

    #[test]
    fn the_base_model_is_the_model_name_label() {
        assert_eq!(base_model(PAGE, EngineKind::Vllm).as_deref(), Some("m"));
        assert_eq!(
            base_model("vllm:num_requests_running 1\n", EngineKind::Vllm),
            None
        );
        assert_eq!(
            base_model(
                "vllm:num_requests_running{model_name=\"\"} 1\n",
                EngineKind::Vllm
            ),
            None
        );
        assert_eq!(
            base_model(SGLANG_PAGE, EngineKind::Sglang).as_deref(),
            Some("qwen")
        );
    }

    /// A page as SGLang's metrics collector writes it (two data-parallel ranks).
    const SGLANG_PAGE: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
sglang:num_running_reqs{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2.0
sglang:num_queue_reqs{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
sglang:token_usage{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.25
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.5
sglang:max_total_num_tokens{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 65536.0
sglang:page_size{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 16.0
sglang:cache_hit_rate{dp_rank="0",engine_type="unified",model_name="qwen",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.7
"#;

    #[test]
    fn reads_the_sglang_series() {
        let (kind, m) = parse(SGLANG_PAGE).unwrap();
        assert_eq!(kind, EngineKind::Sglang);
        assert_eq!(
            m,
            EngineMetrics {
                waiting: 4.0,
                running: 5.0,
                kv_cache_usage: 0.5,
                block_size: Some(16),
                num_gpu_blocks: Some(4096),
                num_cpu_blocks: None,
            }
        );
        // SGLang's default page size is 1 token; a zero or fractional one is no block size.
        let (_, m) = parse(
            "sglang:num_running_reqs 0\nsglang:page_size 1\nsglang:max_total_num_tokens 100\n",
        )
        .unwrap();
        assert_eq!((m.block_size, m.num_gpu_blocks), (Some(1), Some(100)));
        let (_, m) = parse(
            "sglang:num_running_reqs 0\nsglang:page_size 0\nsglang:max_total_num_tokens 100\n",
        )
        .unwrap();
        assert_eq!((m.block_size, m.num_gpu_blocks), (None, None));
        let (_, m) = parse("sglang:num_queue_reqs 1\nsglang:page_size 2.5\n").unwrap();
        assert_eq!(m.block_size, None);
        // Priority scheduling: the total (priority="") and its breakdown; the total counts.
        let (_, m) = parse(
            "sglang:num_queue_reqs{model_name=\"q\",priority=\"\"} 5\n\
             sglang:num_queue_reqs{model_name=\"q\",priority=\"0\"} 2\n\
             sglang:num_queue_reqs{model_name=\"q\",priority=\"1\"} 3\n",
        )
        .unwrap();
        assert_eq!(m.waiting, 5.0);
    }

    #[test]
    fn pages_without_engine_series_are_errors() {
        assert_eq!(parse("{\"backend\":\"a\"}"), Err(NotAnEngine));
        assert_eq!(
            parse("process_cpu_seconds_total 1\n# vllm:num_requests_waiting 3\n"),
            Err(NotAnEngine)
        );
        assert_eq!(
            parse("vllm:num_requests_waiting{a=\"b\"} NaN\n"),
            Err(NotAnEngine)
        );
        // SGLang's constants alone are no load.
        assert_eq!(
            parse("sglang:page_size 16\nsglang:max_total_num_tokens 100\n"),
            Err(NotAnEngine)
        );
    }

    #[test]
    fn a_configured_kind_reads_only_its_own_series() {
        let mixed =
            "sglang:num_queue_reqs 7\nvllm:num_requests_waiting 2\nvllm:num_requests_running 1\n";
        let (kind, m) = parse_as(mixed, Some(EngineKind::Vllm)).unwrap();
        assert_eq!((kind, m.waiting, m.running), (EngineKind::Vllm, 2.0, 1.0));
        let (kind, m) = parse_as(mixed, Some(EngineKind::Sglang)).unwrap();
        assert_eq!((kind, m.waiting, m.running), (EngineKind::Sglang, 7.0, 0.0));
        assert_eq!(parse_as(PAGE, Some(EngineKind::Sglang)), Err(NotAnEngine));
        assert_eq!(
            parse_as(SGLANG_PAGE, Some(EngineKind::Vllm)),
            Err(NotAnEngine)
        );
        // A name that only starts like an engine's is neither.
        assert_eq!(
            parse_as("vllmx:num_requests_waiting 1\n", Some(EngineKind::Vllm)),
            Err(NotAnEngine)
        );
    }

    #[test]
    fn server_info_of_sglang_and_of_anything_else() {
        let info = ServerInfo::parse(
            br#"{"page_size": 16, "max_total_num_tokens": 1600, "dp_size": 1, "kv_events": {}}"#,
        )
        .unwrap();
        assert_eq!((info.page_size, info.capacity_blocks()), (16, Some(100)));
        assert_eq!(ServerInfo::parse(br#"{"page_size": 0}"#), None);
        assert_eq!(ServerInfo::parse(b"not json"), None);
        assert_eq!(ServerInfo::parse(br#"{"model": "m"}"#), None);
    }

    #[test]
    fn the_engines_own_prefix_cache_hit_ratio() {
        let vllm = "vllm:prefix_cache_queries_total{engine=\"0\"} 300\n\
                    vllm:prefix_cache_hits_total{engine=\"0\"} 120\n\
                    vllm:prefix_cache_queries_total{engine=\"1\"} 100\n\
                    vllm:prefix_cache_hits_total{engine=\"1\"} 80\n";
        assert_eq!(prefix_cache_hit_ratio(vllm, EngineKind::Vllm), Some(0.5));
        assert_eq!(
            prefix_cache_hit_ratio("vllm:prefix_cache_queries_total 0\n", EngineKind::Vllm),
            None
        );
        let r = prefix_cache_hit_ratio(SGLANG_PAGE, EngineKind::Sglang).unwrap();
        assert!((r - 0.7).abs() < 1e-9, "{r}");
        assert_eq!(prefix_cache_hit_ratio(PAGE, EngineKind::Sglang), None);
    }
}
