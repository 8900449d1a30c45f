//! `kvepp-bench bench-adapters`: adapter and session affinity through a real Envoy and kvepp.
//!
//! Two workloads on one simulated fleet whose engines hold `--max-loras` LoRA adapters in GPU
//! slots (loading one stalls a step by `--lora-load-ms`, evicting the least recently used idle
//! one when the slots are full) and expose `vllm:lora_requests_info` as vLLM does:
//! - adapters: requests for `--adapters` adapters of Zipf(`--zipf`) popularity, unique prompts
//!   (so no cached prefix ties a request to an engine), run under least loaded, KV-aware picking
//!   blind to adapters (`adapter_affinity.enabled: false`) and KV-aware picking with adapter
//!   affinity (the default): TTFT, adapter loads per second and evictions;
//! - sessions: the multi-turn conversations with a session id per conversation (`x-session-id`),
//!   through one and through two kvepp replicas (replica sync on), with session affinity on (the
//!   default) and off: the share of turns served by the engine that served the previous turn.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::report::{self, Record};
use super::{run_policy, BenchError, BenchSpec, Policy, Replay};
use kvepp::config::Config;
use kvepp_sim::fleet::SimParams;
use kvepp_sim::workload::{self, Request};

/// Requests for adapters of skewed popularity.
#[derive(Debug, Clone)]
pub struct Adapters {
    pub adapters: usize,
    /// Zipf exponent of the adapters' popularity (adapter k has weight 1 / (k + 1)^s).
    pub zipf: f64,
    pub rate: f64,
    pub duration: Duration,
    pub prompt_tokens: (usize, usize),
    pub output_tokens: (u32, u32),
    pub seed: u64,
}

/// The adapter workload: Poisson arrivals, each request for adapter `adapter-<k>` drawn by
/// popularity, with a prompt of its own.
pub fn adapter_requests(w: &Adapters) -> Vec<Request> {
    let mut rng = fastrand::Rng::with_seed(w.seed);
    let weights: Vec<f64> = (0..w.adapters.max(1))
        .map(|k| 1.0 / ((k + 1) as f64).powf(w.zipf))
        .collect();
    let total: f64 = weights.iter().sum();
    let names: Vec<Arc<str>> = (0..weights.len())
        .map(|k| format!("adapter-{k}").into())
        .collect();
    let mut out = Vec::new();
    let mut t = 0.0f64;
    loop {
        t += -(1.0 - rng.f64()).ln() / w.rate.max(1e-9);
        if t >= w.duration.as_secs_f64() {
            break;
        }
        let mut x = rng.f64() * total;
        let k = weights
            .iter()
            .position(|p| {
                x -= p;
                x <= 0.0
            })
            .unwrap_or(weights.len() - 1);
        let n = rng.usize(w.prompt_tokens.0..=w.prompt_tokens.1.max(w.prompt_tokens.0));
        out.push(Request {
            at: Duration::from_secs_f64(t),
            tokens: (0..n).map(|_| rng.u32(..workload::VOCAB as u32)).collect(),
            max_tokens: rng.u32(w.output_tokens.0..=w.output_tokens.1.max(w.output_tokens.0)),
            model: Some(names[k].clone()),
            ..Request::default()
        });
    }
    out
}

/// Gives every conversation (a first turn and the turns that follow it) a session id.
pub fn label_sessions(requests: &mut [Request]) {
    let mut ids: Vec<Arc<str>> = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter_mut().enumerate() {
        let id = match r.after.filter(|&p| p < i) {
            Some(p) => ids[p].clone(),
            None => format!("conversation-{i}").into(),
        };
        r.session = Some(id.clone());
        ids.push(id);
    }
}

/// Turns (after a conversation's first) served by the engine that served the previous turn, and
/// turns whose previous turn was served.
pub fn sticky_turns(requests: &[Request], records: &[Record]) -> (usize, usize) {
    let (mut same, mut turns) = (0, 0);
    for (r, rec) in requests.iter().zip(records) {
        let Some(prev) = r.after.and_then(|p| records.get(p)) else {
            continue;
        };
        let (Some(a), Some(b)) = (&prev.outcome.engine, &rec.outcome.engine) else {
            continue;
        };
        turns += 1;
        same += usize::from(a == b);
    }
    (same, turns)
}

/// Flags of `kvepp-bench bench-adapters`.
#[derive(Debug, Clone, clap::Args)]
pub struct AdapterBenchArgs {
    #[arg(long, default_value = ".venv/bin/envoy")]
    pub envoy: PathBuf,
    #[arg(long, default_value_t = 8)]
    pub engines: usize,
    #[arg(long, default_value_t = 32)]
    pub adapters: usize,
    #[arg(long, default_value_t = 1.1)]
    pub zipf: f64,
    /// GPU adapter slots per engine.
    #[arg(long, default_value_t = 4)]
    pub max_loras: u32,
    #[arg(long, default_value_t = 100.0)]
    pub lora_load_ms: f64,
    /// Adapter workload: requests per second over `--duration` seconds.
    #[arg(long, default_value_t = 30.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 20.0)]
    pub duration: f64,
    /// Session workload: new conversations per second over `--duration` seconds.
    #[arg(long, default_value_t = 3.0)]
    pub conversation_rate: f64,
    #[arg(long, default_value_t = 60.0)]
    pub drain: f64,
    /// kvepp configuration (the fleet's needs); the picker and affinity settings are set per run.
    #[arg(long)]
    pub kvepp_config: Option<PathBuf>,
    #[arg(long, default_value = "bench/results/adapters")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Workloads to run: `adapters`, `sessions` (both by default).
    #[arg(long, value_delimiter = ',', default_value = "adapters,sessions")]
    pub workload: Vec<String>,
}

/// The sum over replicas of one series of their `/metrics` pages.
fn summed(pages: &[String], series: &str) -> u64 {
    pages
        .iter()
        .filter_map(|p| kvepp_test_support::find_sample(p, series))
        .sum::<f64>() as u64
}

/// One session run: replicas, session affinity on, turns on the previous turn's engine, turns,
/// failed requests, and kvepp's session outcomes (hit, moved, new) summed over the replicas.
struct SessionRow {
    replicas: usize,
    on: bool,
    same: usize,
    turns: usize,
    failed: usize,
    outcomes: [u64; 3],
}

/// One run's line of the adapter table.
struct AdapterRow {
    name: String,
    result: report::PolicyResult,
    loads_per_s: f64,
    evictions: u64,
}

fn spec(args: &AdapterBenchArgs, kvepp: &Config, replicas: usize) -> BenchSpec {
    BenchSpec {
        layout: Vec::new(),
        engines: args.engines,
        params: SimParams {
            stream_interval: 16,
            max_loras: args.max_loras,
            lora_load_ms: args.lora_load_ms,
            ..SimParams::default()
        },
        envoy: args.envoy.clone(),
        speed: 1.0,
        drain: Duration::from_secs_f64(args.drain),
        kvepp: kvepp.clone(),
        replicas,
        replica_sync: replicas > 1,
        restart_at: None,
        ips: Vec::new(),
        port: 0,
    }
}

/// The adapter workload under the three pickers.
async fn adapter_rows(
    args: &AdapterBenchArgs,
    kvepp: &Config,
    csv: &mut String,
) -> Result<Vec<AdapterRow>, BenchError> {
    let requests = adapter_requests(&Adapters {
        adapters: args.adapters,
        zipf: args.zipf,
        rate: args.rate,
        duration: Duration::from_secs_f64(args.duration),
        prompt_tokens: (256, 1024),
        output_tokens: (32, 128),
        seed: args.seed,
    });
    let mut rows = Vec::new();
    for (name, policy, aware) in [
        ("least loaded", Policy::LeastLoaded, false),
        ("KV-aware (adapter-blind)", Policy::Precise, false),
        ("KV-aware + adapter affinity", Policy::Precise, true),
    ] {
        let mut spec = spec(args, kvepp, 1);
        spec.kvepp.adapter_affinity.enabled = aware;
        // The adapters have no InferenceModel of their own: routed as named.
        spec.kvepp.unknown_models = kvepp::config::UnknownModels::PassThrough;
        let Replay {
            records,
            engines,
            lora_loads,
            lora_evictions,
            ..
        } = run_policy(&spec, policy, &requests).await?;
        let result = report::summarize(name, &records, &engines, 1000.0);
        report::csv_rows(csv, "adapters", name, &records);
        let span = records
            .iter()
            .filter_map(|r| Some(r.sent + r.outcome.e2e?))
            .max()
            .unwrap_or_default()
            .as_secs_f64()
            .max(1e-3);
        eprintln!(
            "   {name:<28} p50/p90 TTFT {:>6.0}/{:>6.0} ms  loads {lora_loads}  evictions {lora_evictions}  failed {}",
            result.ttft_ms[0], result.ttft_ms[1], result.failed
        );
        rows.push(AdapterRow {
            name: name.to_owned(),
            loads_per_s: lora_loads as f64 / span,
            evictions: lora_evictions,
            result,
        });
    }
    Ok(rows)
}

/// The session workload, through one and two replicas, session affinity on and off.
async fn session_rows(
    args: &AdapterBenchArgs,
    kvepp: &Config,
) -> Result<Vec<SessionRow>, BenchError> {
    let mut requests = workload::multi_turn(&workload::MultiTurn {
        rate: args.conversation_rate,
        duration: Duration::from_secs_f64(args.duration),
        seed: args.seed,
        ..workload::MultiTurn::default()
    });
    label_sessions(&mut requests);
    let mut rows = Vec::new();
    for replicas in [1, 2] {
        for on in [true, false] {
            let mut spec = spec(args, kvepp, replicas);
            if !on {
                spec.kvepp.session_affinity.header = String::new();
            }
            let replay = run_policy(&spec, Policy::Precise, &requests).await?;
            let (same, turns) = sticky_turns(&requests, &replay.records);
            let failed = replay
                .records
                .iter()
                .filter(|r| r.outcome.error.is_some())
                .count();
            let outcomes = ["hit", "moved", "new"].map(|o| {
                summed(
                    &replay.kvepp_metrics,
                    &format!("kvepp_session_affinity_total{{outcome=\"{o}\"}}"),
                )
            });
            eprintln!(
                "   sessions {} replica(s), affinity {}: {same}/{turns} turns on the previous turn's engine, failed {failed}, kvepp hit/moved/new {outcomes:?}, replica sync applied {}",
                replicas,
                if on { "on" } else { "off" },
                summed(&replay.kvepp_metrics, "kvepp_replica_sync_events_total{outcome=\"applied\"}")
            );
            rows.push(SessionRow {
                replicas,
                on,
                same,
                turns,
                failed,
                outcomes,
            });
        }
    }
    Ok(rows)
}

/// The report's markdown.
fn markdown(args: &AdapterBenchArgs, adapters: &[AdapterRow], sessions: &[SessionRow]) -> String {
    let mut md = format!(
        "### Adapters: {} adapters (Zipf {}), {} req/s for {:.0} s, {} engines × {} adapter slots, {:.0} ms per adapter load\n\n\
         | picker | TTFT p50 / p90 ms | adapter loads/s | evictions | failed |\n|---|---|---|---|---|\n",
        args.adapters, args.zipf, args.rate, args.duration, args.engines, args.max_loras, args.lora_load_ms
    );
    for r in adapters {
        md += &format!(
            "| {} | {:.0} / {:.0} | {:.1} | {} | {} |\n",
            r.name,
            r.result.ttft_ms[0],
            r.result.ttft_ms[1],
            r.loads_per_s,
            r.evictions,
            r.result.failed
        );
    }
    if let (Some(blind), Some(aware)) = (
        adapters.iter().find(|r| r.name.contains("blind")),
        adapters.iter().find(|r| r.name.contains("affinity")),
    ) {
        md += &format!(
            "\nAdapter affinity against adapter-blind KV-aware picking: p90 TTFT {:.2}× lower, adapter loads {:.2}× fewer.\n",
            blind.result.ttft_ms[1] / aware.result.ttft_ms[1].max(1e-9),
            blind.loads_per_s / aware.loads_per_s.max(1e-9)
        );
    }
    md += &format!(
        "\n### Sessions: multi-turn conversations ({} new/s for {:.0} s), one session id each, KV-aware picking\n\n\
         | kvepp replicas | session affinity | turns on the previous turn's engine | kvepp: hit / moved / new | failed |\n|---|---|---|---|---|\n",
        args.conversation_rate, args.duration
    );
    for r in sessions {
        md += &format!(
            "| {} | {} | {:.1}% ({} of {}) | {} / {} / {} | {} |\n",
            r.replicas,
            if r.on { "on" } else { "off" },
            100.0 * r.same as f64 / r.turns.max(1) as f64,
            r.same,
            r.turns,
            r.outcomes[0],
            r.outcomes[1],
            r.outcomes[2],
            r.failed
        );
    }
    md
}

/// Runs both workloads, prints the tables and writes `adapters.md`.
pub async fn run(args: AdapterBenchArgs) -> Result<String, BenchError> {
    let io = |e: std::io::Error| BenchError::Io(e.to_string());
    std::fs::create_dir_all(&args.out).map_err(io)?;
    let kvepp = match &args.kvepp_config {
        Some(p) => Config::from_file(p).map_err(|e| BenchError::Kvepp(e.to_string()))?,
        None => Config::default(),
    };
    let wants = |w: &str| args.workload.iter().any(|x| x == w);
    let mut csv = String::from(report::CSV_HEADER);
    let adapters = if wants("adapters") {
        eprintln!("== adapters");
        adapter_rows(&args, &kvepp, &mut csv).await?
    } else {
        Vec::new()
    };
    let sessions = if wants("sessions") {
        eprintln!("== sessions");
        session_rows(&args, &kvepp).await?
    } else {
        Vec::new()
    };
    let md = markdown(&args, &adapters, &sessions);
    println!("{md}");
    std::fs::write(args.out.join("adapters.md"), &md).map_err(io)?;
    std::fs::write(args.out.join("requests.csv"), &csv).map_err(io)?;
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn popularity_is_skewed_and_sessions_follow_conversations() {
        let w = Adapters {
            adapters: 32,
            zipf: 1.1,
            rate: 200.0,
            duration: Duration::from_secs(10),
            prompt_tokens: (4, 8),
            output_tokens: (1, 2),
            seed: 1,
        };
        let r = adapter_requests(&w);
        let count = |name: &str| {
            r.iter()
                .filter(|q| q.model.as_deref() == Some(name))
                .count()
        };
        assert!(
            count("adapter-0") > 4 * count("adapter-9"),
            "{}",
            count("adapter-0")
        );
        assert!(count("adapter-31") > 0);
        let mut turns = workload::multi_turn(&workload::MultiTurn::default());
        label_sessions(&mut turns);
        for t in &turns {
            if let Some(p) = t.after {
                assert_eq!(t.session, turns[p].session);
            }
        }
        let firsts = turns.iter().filter(|t| t.after.is_none()).count();
        let mut ids: Vec<_> = turns.iter().filter_map(|t| t.session.clone()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), firsts);
    }
}
