//! Prometheus metrics: the registry and every family kvepp exposes (text exposition served by the `api` module).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::Mutex;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// The outcome of a request: the HTTP status the client got, or that no response was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    Status(u16),
    /// The stream ended before a response status was observed (client abort, proxy reset, or the
    /// proxy does not send response headers to the EPP).
    NoResponse,
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        use std::fmt::Write;
        match self {
            Outcome::Status(code) => write!(encoder, "{code}"),
            Outcome::NoResponse => encoder.write_str("no_response"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RequestLabels {
    pub model: Arc<str>,
    pub target_model: Arc<str>,
    pub endpoint: Arc<str>,
    pub code: Outcome,
}

/// Label values of an unbounded source (tenants, paths) kept to a bounded set: the first `max`
/// values seen keep their name, every later one is `other`.
#[derive(Debug)]
pub struct BoundedLabels {
    max: usize,
    seen: Mutex<std::collections::HashSet<Arc<str>>>,
    other: Arc<str>,
}

impl BoundedLabels {
    pub fn new(max: usize) -> Self {
        BoundedLabels {
            max,
            seen: Mutex::default(),
            other: "other".into(),
        }
    }

    /// The label `value` is counted under.
    pub fn label(&self, value: &str) -> Arc<str> {
        let mut seen = self.seen.lock();
        match seen.get(value) {
            Some(v) => v.clone(),
            None if seen.len() < self.max => {
                let v: Arc<str> = value.into();
                seen.insert(v.clone());
                v
            }
            None => self.other.clone(),
        }
    }
}

/// A request path, or `other` past the labelled ones.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PathLabels {
    pub path: Arc<str>,
}

/// A tenant (fairness id), or `other` past the labelled ones.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct TenantLabels {
    pub tenant: Arc<str>,
}

/// A pool and a (target) model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PoolModelLabels {
    pub pool: Arc<str>,
    pub model: Arc<str>,
}

/// An InferenceModelRewrite and the target model it chose.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct RewriteLabels {
    pub rewrite: Arc<str>,
    pub target_model: Arc<str>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct EndpointLabels {
    pub endpoint: Arc<str>,
}

/// A disaggregated pick's pair, by the configured topology level's value on each side (`none`:
/// no level configured, or the worker lacks it).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PairLabels {
    pub prefill_domain: String,
    pub decode_domain: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ResourceLabels {
    pub resource: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PriorityLabels {
    pub priority: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ModeLabels {
    pub mode: &'static str,
}

/// A cache's lookups by result.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CacheLabels {
    pub model: Arc<str>,
    /// `messages` (chat messages as template values), `segments` (token ids of the text between
    /// added tokens) or `renders` (rendered chat prompts resumed from a recent one).
    pub cache: &'static str,
    /// `hit` or `miss`.
    pub result: &'static str,
}

/// Brings a counter that mirrors a count kept elsewhere (which only grows) up to it.
pub(crate) fn catch_up(counter: &Counter, count: u64) {
    counter.inc_by(count.saturating_sub(counter.get()));
}

/// A step of preparing a request's facts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct StepLabels {
    /// `parse` (a body read), `tokenize` (a prompt's text tokenized by kvepp), `hash` (a prompt
    /// hashed into KV blocks).
    pub step: &'static str,
}

/// What preparing requests took, by step (`kvepp_request_preparation_steps_total`): each is done
/// once per request, however many times flow control lets it try.
#[derive(Debug, Clone, Default)]
pub struct PrepareSteps(pub Family<StepLabels, Counter>);

impl PrepareSteps {
    pub(crate) fn count(&self, step: &'static str) {
        self.0.get_or_create(&StepLabels { step }).inc();
    }
}

/// How a token prompt's block hashes, or its ids, were found.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct HashSourceLabels {
    /// Hashes: `reused` (copied from the recent prompt that starts the same way) or `hashed`.
    /// Ids: `cached` (a chunk the chunk cache held) or `read` (from the body).
    pub source: &'static str,
}

/// How a KV-aware pick found its endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct PickPathLabels {
    /// `ordered` (the holders and the least loaded by load order) or `scan` (every candidate).
    pub path: &'static str,
}

/// A model's tokenizer.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ModelLabels {
    pub model: Arc<str>,
}

/// The running counts of one model's tokenizer, kept with it (read at each scrape).
#[derive(Debug, Clone)]
pub struct TokenizerSample {
    pub model: Arc<str>,
    /// Each cache's name, hits and misses.
    pub caches: Vec<(&'static str, u64, u64)>,
    /// Calls into the tokenizer and the thread CPU time they took.
    pub calls: u64,
    pub cpu_nanos: u64,
}

type TokenizerSource = Box<dyn Fn() -> Option<TokenizerSample> + Send + Sync>;

/// Where the tokenizer counters come from (the models' tokenizers), read at each scrape.
#[derive(Default)]
struct TokenizerSources(parking_lot::Mutex<Vec<TokenizerSource>>);

impl std::fmt::Debug for TokenizerSources {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenizerSources")
    }
}

/// A component's metric families: the component registers them itself, into the process's
/// registry ([`Metrics::add`]), so nothing here needs to know the component.
pub trait Register {
    fn register(&self, registry: &mut Registry);
}

#[derive(Debug)]
pub struct Metrics {
    /// Behind a lock so components started later register their own families ([`Register`]).
    registry: Mutex<Registry>,
    /// Tokenizer cache lookups by model, cache and result (brought up to date at each scrape).
    pub cache_lookups: Family<CacheLabels, Counter>,
    /// Calls into each model's tokenizer and the CPU time they took (up to date at each scrape).
    pub tokenizer_calls: Family<ModelLabels, Counter>,
    pub tokenizer_cpu: Family<ModelLabels, Counter<f64, AtomicU64>>,
    tokenizer_sources: TokenizerSources,
    /// Full blocks of token prompts by how their hashes were found (set at each scrape).
    pub prompt_hash_blocks: Family<HashSourceLabels, Counter>,
    /// Token ids of `prompt` arrays by where they came from (counted as requests are read).
    pub prompt_token_ids: Family<HashSourceLabels, Counter>,
    pub kv_picks: Family<PickPathLabels, Counter>,
    pub requests: Family<RequestLabels, Counter>,
    pub prepare_steps: PrepareSteps,
    pub pick_duration: Histogram,
    pub in_flight: Gauge,
    pub rejected: Family<ReasonLabels, Counter>,
    pub served_elsewhere: Counter,
    /// Requests for paths kvepp does not know (routed by load), by path.
    pub unknown_paths: Family<PathLabels, Counter>,
    /// Requests an InferenceModelRewrite decided, by rewrite and target model.
    pub model_rewrites: Family<RewriteLabels, Counter>,
    /// Of those, the ones the engine answered 404: the target names a model it does not serve.
    pub model_rewrite_unserved: Family<RewriteLabels, Counter>,
    pub prefix_mode: Family<ModeLabels, Counter>,
    /// KV-aware picks made again because the chosen endpoint's load changed before the booking.
    pub repicks: Counter,
    /// KV-aware picks where bounded loads (`router.load_bound`) passed over a cheaper endpoint.
    pub load_bounded: Counter,
    /// Prompt blocks of KV-aware picks, and of those the picked endpoint had cached, by mode.
    pub prefix_blocks: Family<ModeLabels, Counter>,
    pub prefix_matched_blocks: Family<ModeLabels, Counter>,
    /// Requests in flight through kvepp per ready endpoint (set at each scrape).
    pub endpoint_in_flight: Family<EndpointLabels, Gauge>,
    /// HTTP requests refused for a missing or wrong bearer token.
    pub http_unauthorized: Counter,
    /// ext_proc connections closed before serving (refused plaintext, failed TLS handshake).
    pub grpc_connections_refused: Counter,
    /// Tasks alive in kvepp's runtime (set at each scrape; a leak shows as growth).
    pub runtime_alive_tasks: Gauge,
    /// Disaggregated picks (prefill worker → decode worker) by topology domains.
    pub pd_pairs: Family<PairLabels, Counter>,
    /// Disaggregated picks whose decode worker is outside the prefill worker's domain (fallback
    /// policy).
    pub pd_cross_domain: Counter,
}

impl Metrics {
    pub fn new() -> Arc<Self> {
        let m = Metrics {
            registry: Mutex::new(Registry::with_prefix("kvepp")),
            requests: Family::<RequestLabels, Counter>::default(),
            prepare_steps: PrepareSteps::default(),
            pick_duration: Histogram::new(exponential_buckets(1e-6, 2.0, 22)),
            http_unauthorized: Counter::default(),
            grpc_connections_refused: Counter::default(),
            runtime_alive_tasks: Gauge::default(),
            pd_pairs: Family::<PairLabels, Counter>::default(),
            pd_cross_domain: Counter::default(),
            in_flight: Gauge::default(),
            rejected: Family::<ReasonLabels, Counter>::default(),
            served_elsewhere: Counter::default(),
            model_rewrites: Family::default(),
            unknown_paths: Family::default(),
            model_rewrite_unserved: Family::default(),
            prefix_mode: Family::<ModeLabels, Counter>::default(),
            repicks: Counter::default(),
            load_bounded: Counter::default(),
            prefix_blocks: Family::<ModeLabels, Counter>::default(),
            prefix_matched_blocks: Family::<ModeLabels, Counter>::default(),
            prompt_hash_blocks: Family::<HashSourceLabels, Counter>::default(),
            prompt_token_ids: Family::<HashSourceLabels, Counter>::default(),
            kv_picks: Family::<PickPathLabels, Counter>::default(),
            cache_lookups: Family::<CacheLabels, Counter>::default(),
            tokenizer_calls: Family::<ModelLabels, Counter>::default(),
            tokenizer_cpu: Family::<ModelLabels, Counter<f64, AtomicU64>>::default(),
            endpoint_in_flight: Family::<EndpointLabels, Gauge>::default(),
            tokenizer_sources: TokenizerSources::default(),
        };
        {
            let mut registry = m.registry.lock();
            m.register_requests(&mut registry);
            m.register_build(&mut registry);
            m.register_prefixes(&mut registry);
        }
        Arc::new(m)
    }

    /// The request path's families (the ext_proc door) and the servers'.
    fn register_requests(&self, registry: &mut Registry) {
        registry.register(
            "requests",
            "Requests by model, target model, endpoint and status code",
            self.requests.clone(),
        );
        registry.register(
            "request_preparation_steps",
            "Steps of preparing requests for routing (parse, tokenize, hash), each once per request",
            self.prepare_steps.0.clone(),
        );
        registry.register(
            "pick_duration_seconds",
            "Time from complete request (headers or body) to the pick",
            self.pick_duration.clone(),
        );
        registry.register(
            "http_unauthorized_requests",
            "HTTP requests refused with 401 (missing or wrong bearer token)",
            self.http_unauthorized.clone(),
        );
        registry.register(
            "grpc_connections_refused",
            "ext_proc connections closed before serving: refused plaintext, failed or slow TLS handshake",
            self.grpc_connections_refused.clone(),
        );
        registry.register(
            "runtime_alive_tasks",
            "Tasks alive in kvepp's async runtime, read at each scrape",
            self.runtime_alive_tasks.clone(),
        );
        registry.register(
            "pd_pairs",
            "Disaggregated picks by the prefill and decode workers' topology domains",
            self.pd_pairs.clone(),
        );
        registry.register(
            "pd_cross_domain",
            "Disaggregated picks sent across topology domains (kv_transfer_mismatch_policy fallback)",
            self.pd_cross_domain.clone(),
        );
        registry.register(
            "in_flight_requests",
            "Requests routed and not yet finished",
            self.in_flight.clone(),
        );
        registry.register(
            "rejected_requests",
            "Requests answered by the EPP itself, by reason",
            self.rejected.clone(),
        );
        registry.register(
            "served_elsewhere",
            "Requests the proxy reports served by another endpoint than the primary pick",
            self.served_elsewhere.clone(),
        );
        registry.register(
            "unknown_path_requests",
            "Requests for paths kvepp does not read (routed by load, body untouched), by path (the first 32 paths by name, the rest as other)",
            self.unknown_paths.clone(),
        );
        registry.register(
            "model_rewrites",
            "Requests whose model an InferenceModelRewrite decided, by rewrite and target model",
            self.model_rewrites.clone(),
        );
        registry.register(
            "model_rewrite_unserved",
            "Rewritten requests the engine answered 404 (the rewrite's target model is not served there), by rewrite and target model",
            self.model_rewrite_unserved.clone(),
        );
        registry.register(
            "kv_prefix_mode",
            "KV-aware picks by how the prompt prefix was found (token_ids, tokens, approximate, none)",
            self.prefix_mode.clone(),
        );
        registry.register(
            "kv_repicks",
            "KV-aware picks made again because the chosen endpoint's load changed before the booking (a concurrent pick booked it or a request there ended)",
            self.repicks.clone(),
        );
        registry.register(
            "kv_load_bounded_picks",
            "KV-aware picks where bounded loads (router.load_bound) passed over a cheaper endpoint holding more than its share of requests",
            self.load_bounded.clone(),
        );
    }

    /// The build.
    fn register_build(&self, registry: &mut Registry) {
        let info = Family::<[(&'static str, &'static str); 2], Gauge>::default();
        registry.register("build_info", "kvepp version and commit", info.clone());
        info.get_or_create(&[
            ("version", env!("CARGO_PKG_VERSION")),
            ("commit", env!("KVEPP_GIT_SHA")),
        ])
        .set(1);
    }

    /// Prefix matching, tokenizers and per-endpoint load.
    fn register_prefixes(&self, registry: &mut Registry) {
        registry.register(
            "kv_prefix_blocks",
            "Prompt KV blocks of KV-aware picks, by prefix mode",
            self.prefix_blocks.clone(),
        );
        registry.register(
            "kv_prefix_matched_blocks",
            "Prompt KV blocks the picked endpoint had cached (device, host or disk), by prefix mode",
            self.prefix_matched_blocks.clone(),
        );
        registry.register(
            "kv_prompt_hash_blocks",
            "Full blocks of prompts (token ids, or a text's approximate blocks) by how their \
             hashes were found: reused from the recent prompt that starts the same way, or hashed",
            self.prompt_hash_blocks.clone(),
        );
        registry.register(
            "prompt_token_ids",
            "Token ids of completions prompts given as ids, by where they came from: cached (a \
             chunk of the array the chunk cache held, not read) or read (from the body)",
            self.prompt_token_ids.clone(),
        );
        registry.register(
            "kv_picks",
            "KV-aware picks by how the endpoint was found: ordered (Dynamo's cost at temperature \
             0 without bounded loads: the prompt's holders and the least loaded, by the slot \
             tracker's load order) or scan (every candidate read)",
            self.kv_picks.clone(),
        );
        registry.register(
            "tokenizer_cache_lookups",
            "Lookups in a model's tokenizer caches (messages: chat messages as template values; \
             segments: token ids of the text between added tokens; renders: rendered chat \
             prompts resumed from a recent render), by result",
            self.cache_lookups.clone(),
        );
        registry.register(
            "tokenizer_calls",
            "Calls into a model's tokenizer (a completions prompt, or a chat segment the segment \
             cache did not hold)",
            self.tokenizer_calls.clone(),
        );
        registry.register(
            "tokenizer_cpu_seconds",
            "CPU time the threads calling a model's tokenizer spent in it",
            self.tokenizer_cpu.clone(),
        );
        registry.register(
            "endpoint_in_flight_requests",
            "Requests in flight through kvepp, per ready endpoint",
            self.endpoint_in_flight.clone(),
        );
    }

    /// Registers a component's families (its names under the `kvepp_` prefix).
    pub fn add(&self, component: &dyn Register) {
        component.register(&mut self.registry.lock());
    }

    /// Counts a disaggregated pick's pair.
    pub(crate) fn count_pair(&self, p: &kvepp_core::Pairing) {
        let d = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".to_owned());
        self.pd_pairs
            .get_or_create(&PairLabels {
                prefill_domain: d(&p.prefill_domain),
                decode_domain: d(&p.decode_domain),
            })
            .inc();
        if p.crossed {
            self.pd_cross_domain.inc();
        }
    }

    /// Counts one KV-aware pick in its prefix mode.
    pub(crate) fn count_prefix_mode(&self, mode: &'static str) {
        self.prefix_mode.get_or_create(&ModeLabels { mode }).inc();
    }

    /// Counts a KV-aware pick's prompt blocks and how many of them the picked endpoint had.
    pub fn count_prefix_blocks(&self, mode: &'static str, prompt: u64, matched: u64) {
        let l = ModeLabels { mode };
        self.prefix_blocks.get_or_create(&l).inc_by(prompt);
        self.prefix_matched_blocks
            .get_or_create(&l)
            .inc_by(matched.min(prompt));
    }

    /// Adds a source of tokenizer counts, read at each scrape.
    pub(crate) fn add_tokenizer_source(&self, source: TokenizerSource) {
        self.tokenizer_sources.0.lock().push(source);
    }

    /// Brings the tokenizer counters up to their sources' counts (which only grow).
    pub(crate) fn collect_tokenizers(&self) {
        let sources = self.tokenizer_sources.0.lock();
        for sample in sources.iter().filter_map(|source| source()) {
            for &(cache, hits, misses) in &sample.caches {
                for (result, count) in [("hit", hits), ("miss", misses)] {
                    let counter = self.cache_lookups.get_or_create(&CacheLabels {
                        model: sample.model.clone(),
                        cache,
                        result,
                    });
                    catch_up(&counter, count);
                }
            }
            let model = ModelLabels {
                model: sample.model.clone(),
            };
            catch_up(&self.tokenizer_calls.get_or_create(&model), sample.calls);
            let cpu = self.tokenizer_cpu.get_or_create(&model);
            let seconds = sample.cpu_nanos as f64 / 1e9;
            cpu.inc_by((seconds - cpu.get()).max(0.0));
        }
    }

    /// Brings the prompt-hash counters up to the routing core's counts (which only grow).
    pub(crate) fn collect_prompt_hashes(&self, stats: kvepp_core::hash::MemoStats) {
        for (source, count) in [
            ("reused", stats.blocks_reused),
            ("hashed", stats.blocks_hashed),
        ] {
            let counter = self
                .prompt_hash_blocks
                .get_or_create(&HashSourceLabels { source });
            catch_up(&counter, count);
        }
    }

    /// KV-aware picks by path ([`kvepp_core::KvState::pick_paths`]).
    pub(crate) fn collect_pick_paths(&self, (ordered, scanned): (u64, u64)) {
        for (path, count) in [("ordered", ordered), ("scan", scanned)] {
            catch_up(
                &self.kv_picks.get_or_create(&PickPathLabels { path }),
                count,
            );
        }
    }

    /// Prometheus text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry.lock());
        out
    }
}
