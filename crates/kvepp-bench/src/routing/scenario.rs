//! The workloads of `kvepp-bench bench-routing` ([`WorkloadKind`]) and how each is set up for a
//! replay: its requests, engine parameters, speed, replicas and restart ([`scenario`]), and what
//! a restart left behind ([`orphaned_turns`]).

use std::time::Duration;

use super::report::Record;
use super::{BenchArgs, BenchError};
use kvepp_sim::fleet::SimParams;
use kvepp_sim::workload::{self, Request};

/// The workloads `kvepp-bench bench-routing` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Groups of requests sharing a long system prompt.
    SharedPrefix,
    /// The Mooncake conversation trace.
    Mooncake,
    /// Multi-turn conversations (each turn carries the previous prompt and answer).
    MultiTurn,
    /// The conversations through two kvepp replicas behind the one Envoy, replica sync on and
    /// off (KV-aware policies run once each way).
    MultiTurnReplicas,
    /// The conversations with a second client sending a share of them straight to the engines.
    Mixed,
    /// The conversations with the first engine restarting halfway.
    Restart,
    /// Bursts of requests sharing a prefix no engine has seen, arriving within milliseconds.
    Burst,
}

impl WorkloadKind {
    pub const ALL: [WorkloadKind; 7] = [
        WorkloadKind::SharedPrefix,
        WorkloadKind::Mooncake,
        WorkloadKind::MultiTurn,
        WorkloadKind::MultiTurnReplicas,
        WorkloadKind::Mixed,
        WorkloadKind::Restart,
        WorkloadKind::Burst,
    ];

    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::SharedPrefix => "shared-prefix",
            WorkloadKind::Mooncake => "mooncake",
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::MultiTurnReplicas => "multi-turn-replicas",
            WorkloadKind::Mixed => "mixed",
            WorkloadKind::Restart => "restart",
            WorkloadKind::Burst => "burst",
        }
    }
}

/// Engine parameters of the shared-prefix workload: an 8B model on one H100 with a 64k-token KV
/// cache (the rest of the memory taken by a larger model or other tenants), so 48 system prompts
/// of 4k tokens fit in the fleet's caches but not in each engine's.
pub fn shared_prefix_params() -> SimParams {
    SimParams {
        total_kv_blocks: 4096,
        stream_interval: 16,
        ..SimParams::default()
    }
}

fn replicas_note(args: &BenchArgs) -> String {
    match (args.replicas, args.replica_sync) {
        (0 | 1, _) => String::new(),
        (n, true) => format!(", {n} kvepp replicas with replica sync"),
        (n, false) => format!(", {n} kvepp replicas without replica sync"),
    }
}

fn disaggregation_note(args: &BenchArgs) -> String {
    if args.prefill_engines == 0 {
        return String::new();
    }
    format!(
        " ({} prefill, {} decode, zones {})",
        args.prefill_engines.min(args.engines),
        args.engines.saturating_sub(args.prefill_engines),
        args.zones.join("/")
    )
}

/// One workload's replay setup.
pub(super) struct Scenario {
    pub(super) title: String,
    pub(super) requests: Vec<Request>,
    pub(super) params: SimParams,
    pub(super) speed: f64,
    /// Simulated engines.
    pub(super) engines: usize,
    pub(super) replicas: usize,
    /// Replica sync settings to compare (KV-aware policies run once per entry).
    pub(super) sync: Vec<bool>,
    pub(super) restart_at: Option<Duration>,
}

pub(super) fn scenario(kind: WorkloadKind, args: &BenchArgs) -> Result<Scenario, BenchError> {
    let h100 = SimParams {
        stream_interval: 16,
        ..SimParams::default()
    };
    let conversations = |direct_share: f64| workload::MultiTurn {
        rate: args.conversation_rate,
        duration: Duration::from_secs_f64(args.duration),
        direct_share,
        ..workload::MultiTurn::default()
    };
    let conversation_title = |m: &workload::MultiTurn| {
        format!(
            "{:.0} new conversations/s for {:.0} s, {}-{} turns, {} system prompts of {} tokens, {} engines",
            m.rate, args.duration, m.turns.0, m.turns.1, m.system_prompts, m.system_tokens, args.engines
        )
    };
    let mut s = Scenario {
        title: String::new(),
        requests: Vec::new(),
        params: shared_prefix_params(),
        speed: 1.0,
        engines: args.engines,
        replicas: args.replicas,
        sync: vec![args.replica_sync],
        restart_at: None,
    };
    match kind {
        WorkloadKind::SharedPrefix => {
            let w = workload::SharedPrefix {
                groups: args.groups,
                rate: args.rate,
                duration: Duration::from_secs_f64(args.duration),
                ..workload::SharedPrefix::default()
            };
            s.title = format!(
                "shared prefix: {} groups × {}-token system prompt + {}-token question, {:.0} req/s for {:.0} s, {} engines{}{}",
                w.groups, w.system_tokens, w.user_tokens, w.rate, args.duration, args.engines,
                replicas_note(args), disaggregation_note(args)
            );
            s.requests = workload::shared_prefix(&w);
        }
        WorkloadKind::Mooncake => {
            s.requests = workload::mooncake(&args.trace, args.trace_requests, args.max_output)?;
            s.engines = args.trace_engines.unwrap_or(args.engines);
            s.title = format!(
                "Mooncake conversation trace: first {} requests at {}× speed, {} engines{}",
                s.requests.len(),
                args.speed,
                s.engines,
                disaggregation_note(args)
            );
            s.params = h100;
            s.speed = args.speed;
        }
        WorkloadKind::MultiTurn | WorkloadKind::Mixed | WorkloadKind::Restart => {
            let share = if kind == WorkloadKind::Mixed {
                args.direct_share
            } else {
                0.0
            };
            let m = conversations(share);
            s.requests = workload::multi_turn(&m);
            s.title = match kind {
                WorkloadKind::Mixed => format!(
                    "mixed: {}; {:.0}% of the conversations sent straight to the engines by a second client",
                    conversation_title(&m),
                    share * 100.0
                ),
                WorkloadKind::Restart => {
                    s.restart_at = Some(Duration::from_secs_f64(args.duration / 2.0));
                    format!(
                        "restart: {}; the first engine restarts (cache emptied) at {:.0} s",
                        conversation_title(&m),
                        args.duration / 2.0
                    )
                }
                _ => format!("multi-turn: {}{}", conversation_title(&m), replicas_note(args)),
            };
        }
        WorkloadKind::Burst => {
            let b = workload::Burst {
                bursts: (args.duration * 2.0).max(1.0) as usize,
                ..workload::Burst::default()
            };
            s.requests = workload::burst(&b);
            s.title = format!(
                "burst: every {} ms a new {}-token prefix with {} requests within {} ms ({}-token questions), {} bursts, {} engines{}",
                b.spacing.as_millis(), b.prefix_tokens, b.size, b.spread.as_millis(), b.user_tokens,
                b.bursts, args.engines, replicas_note(args)
            );
        }
        WorkloadKind::MultiTurnReplicas => {
            let m = conversations(0.0);
            s.requests = workload::multi_turn(&m);
            s.replicas = args.replicas.max(2);
            s.sync = vec![true, false];
            s.title = format!(
                "multi-turn, {} kvepp replicas: {}",
                s.replicas,
                conversation_title(&m)
            );
        }
    }
    if let Some(p) = &args.params {
        s.params = SimParams::from_file(p)?;
    }
    Ok(s)
}

/// After an engine restart at `at`: the routed turns whose previous turn that engine served before
/// the restart (their cache died with it), and how many of them were sent back to it.
pub fn orphaned_turns(
    requests: &[Request],
    records: &[Record],
    engine: &str,
    at: Duration,
) -> (usize, usize) {
    let (mut orphans, mut back) = (0, 0);
    for (r, rec) in requests.iter().zip(records) {
        let Some(prev) = r.after.and_then(|i| records.get(i)) else {
            continue;
        };
        if rec.direct || rec.sent < at || prev.sent >= at {
            continue;
        }
        if prev.outcome.engine.as_deref() == Some(engine) {
            orphans += 1;
            back += usize::from(rec.outcome.engine.as_deref() == Some(engine));
        }
    }
    (orphans, back)
}
