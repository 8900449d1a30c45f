//! `kvepp-bench bench-routing`: replays a workload open-loop through a real Envoy and kvepp to a
//! simulated fleet ([`kvepp_sim::fleet`]), once per routing policy, and reports TTFT, end-to-end
//! latency, output throughput, prefix-cache hit ratio and load imbalance per policy.
//!
//! Every policy gets a fresh fleet (empty caches), a fresh kvepp (in this process, the same code
//! `kvepp serve` runs, configured through [`Config`]) and a fresh Envoy. Requests leave at the
//! workload's timestamps divided by the speed factor whether or not earlier ones are done, so
//! overload shows up as queueing.

pub mod affinity;
mod args;
pub mod oracle;
mod policy;
pub mod report;
mod scenario;

pub use args::BenchArgs;
pub use policy::Policy;
use scenario::scenario;
pub use scenario::{orphaned_turns, shared_prefix_params, WorkloadKind};

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use kvepp::config::Config;
use kvepp_sim::client;
use kvepp_sim::fleet::{EngineLayout, Fleet, FleetSpec, SimParams};
use kvepp_sim::workload::{self, Request};
use kvepp_test_support::envoy::EnvoyProcess;
pub use kvepp_test_support::wait_until;
use kvepp_test_support::TempDir;
use report::{PolicyResult, Record};

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Sim(#[from] kvepp_sim::fleet::SimError),
    #[error(transparent)]
    Workload(#[from] workload::WorkloadError),
    #[error(transparent)]
    Envoy(#[from] kvepp_test_support::envoy::EnvoyError),
    #[error("kvepp: {0}")]
    Kvepp(String),
    #[error("{0}")]
    Io(String),
}

/// How a disaggregated fleet's KV transfers are constrained (the design's settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Topology {
    /// No topology: the decode worker is picked by load alone.
    Off,
    /// `kv_transfer_topology_level: zone` (policy `fail`).
    Hard,
    /// `kv_transfer_weight` only: the transfer cost joins the decode cost.
    Soft,
    /// Both: the zone filter, then the transfer cost within the zone.
    HardSoft,
}

impl Topology {
    pub fn name(self) -> &'static str {
        match self {
            Topology::Off => "topology off",
            Topology::Hard => "hard filter",
            Topology::Soft => "soft preference",
            Topology::HardSoft => "hard + soft",
        }
    }

    /// `base`'s disaggregation settings for this mode (`weight` for the soft ones).
    pub fn apply(self, base: &mut Config, weight: f64) {
        let d = &mut base.disaggregation;
        let (level, w) = match self {
            Topology::Off => (None, 0.0),
            Topology::Hard => (Some("zone"), 0.0),
            Topology::Soft => (None, weight),
            Topology::HardSoft => (Some("zone"), weight),
        };
        d.kv_transfer_topology_level = level.map(str::to_owned);
        d.kv_transfer_weight = w;
    }
}

/// One replay's setup.
#[derive(Debug, Clone)]
pub struct BenchSpec {
    /// Roles and topology of the engines (empty: every engine does both, no topology).
    pub layout: Vec<EngineLayout>,
    pub engines: usize,
    pub params: SimParams,
    pub envoy: PathBuf,
    /// Timestamps are divided by it.
    pub speed: f64,
    /// How long to wait for the last responses after the last request left.
    pub drain: Duration,
    /// kvepp's configuration; the picker, ports, pool and manifests are set per run.
    pub kvepp: Config,
    /// kvepp replicas behind the one Envoy (its ext_proc cluster spreads streams over them).
    pub replicas: usize,
    /// With several replicas: replica sync between them.
    pub replica_sync: bool,
    /// When (workload time, before the speed factor) the first engine restarts, if ever.
    pub restart_at: Option<Duration>,
    /// Engine `i`'s own address where given, and every engine's port (0: ephemeral).
    pub ips: Vec<std::net::IpAddr>,
    pub port: u16,
}

/// Who routes a replay.
#[derive(Debug, Clone, Copy)]
pub enum Router {
    /// kvepp started here under this policy (or the policy's reference placement).
    Kvepp(Policy),
    /// A router running on its own (its ext_proc gRPC address), discovering the fleet itself.
    External(std::net::SocketAddr),
}

/// kvepp serving from a manifests directory, in this process.
struct Kvepp(kvepp::server::InProcess);

impl Kvepp {
    async fn start(
        base: &Config,
        manifests: &std::path::Path,
        pool: &str,
        policy: Policy,
        block_size: u32,
    ) -> Result<Self, BenchError> {
        let cfg = Config {
            bind_address: std::net::Ipv4Addr::LOCALHOST.into(),
            grpc_port: 0,
            grpc_health_port: 0,
            metrics_port: 0,
            pool_name: pool.into(),
            manifests_dir: Some(manifests.to_owned()),
            manifests_poll_ms: 100,
            shutdown_grace_seconds: 1,
            shutdown_delay_ms: 0,
            log_level: "warn".into(),
            picker: policy.picker(),
            block_size: Some(block_size),
            router: kvepp_core::cost::CostWeights {
                cost_model: policy.cost_model().unwrap_or(base.router.cost_model),
                ..base.router
            },
            ..base.clone()
        };
        cfg.validate().map_err(|e| {
            BenchError::Kvepp(
                e.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        })?;
        kvepp::server::InProcess::start(cfg)
            .await
            .map(Kvepp)
            .map_err(|e| BenchError::Kvepp(e.to_string()))
    }

    /// The value of one metric series, when present.
    async fn metric(&self, series: &str) -> Option<f64> {
        let (_, text) = kvepp_test_support::client::fetch(self.0.metrics, "/metrics")
            .await
            .ok()?;
        kvepp_test_support::find_sample(&text, series)
    }

    async fn stop(self) {
        if let Err(e) = self.0.stop().await {
            tracing::error!(%e, "kvepp stopped");
        }
    }
}

/// What one policy's replay gives back.
pub struct Replay {
    pub records: Vec<Record>,
    /// The engines that answered clients, by name.
    pub engines: Vec<String>,
    /// With a restart and KV events: how long after the restart kvepp had dropped the restarted
    /// engine's blocks (its publisher seen restarting), polled every 20 ms; None when not seen
    /// within 5 s.
    pub restart_cleared_after: Option<Duration>,
    /// LoRA adapters the engines loaded into a GPU slot, and evicted, over the run.
    pub lora_loads: u64,
    pub lora_evictions: u64,
    /// Each replica's `/metrics` page at the end of the run.
    pub kvepp_metrics: Vec<String>,
}

/// Replays `requests` under `policy`: every request's record and the engines' names.
pub async fn run_policy(
    spec: &BenchSpec,
    policy: Policy,
    requests: &[Request],
) -> Result<Replay, BenchError> {
    run_router(spec, Router::Kvepp(policy), requests).await
}

/// Replays `requests` routed by `router` in front of a fresh fleet.
pub async fn run_router(
    spec: &BenchSpec,
    router: Router,
    requests: &[Request],
) -> Result<Replay, BenchError> {
    let fleet = Fleet::start(FleetSpec {
        engines: spec.engines,
        params: spec.params.clone(),
        layout: spec.layout.clone(),
        ips: spec.ips.clone(),
        port: spec.port,
        ..FleetSpec::default()
    })
    .await?;
    let dir = TempDir::new("bench-manifests");
    fleet.write_manifests(dir.path())?;
    // The engines that answer clients (a prefill engine only answers its decode engines).
    let answering: Vec<&kvepp_sim::fleet::SimEngine> = fleet
        .engines
        .iter()
        .filter(|e| e.layout.role.decodes())
        .collect();
    // What follows asks the policy only of kvepp started here (its metrics, KV-event waits);
    // an external router has none of that.
    let policy = match router {
        Router::Kvepp(policy) => policy,
        Router::External(_) => Policy::RoundRobin,
    };
    let (kvepps, envoy, door) = if let Router::External(grpc) = router {
        let envoy = EnvoyProcess::start_with(&spec.envoy, EnvoyProcess::bootstrap()?, grpc).await?;
        routes_to_every_engine(envoy.listener, &fleet).await?;
        let door = Door::Envoy(envoy.listener);
        (Vec::new(), Some(envoy), door)
    } else if let Some(objective) = policy.reference() {
        let engines = answering.iter().map(|e| (e.http, e.core.clone()));
        let oracle = oracle::Clairvoyant::new(engines, objective);
        (Vec::new(), None, Door::Oracle(std::sync::Arc::new(oracle)))
    } else {
        let kvepps = start_replicas(spec, policy, dir.path(), &fleet).await?;
        wait_ready(spec, policy, &kvepps).await?;
        // On an early return, dropping the replicas shuts them down.
        let bootstrap = envoy_bootstrap(&kvepps)?;
        let envoy = EnvoyProcess::start_with(&spec.envoy, bootstrap, kvepps[0].0.grpc).await?;
        let door = Door::Envoy(envoy.listener);
        (kvepps, Some(envoy), door)
    };
    let start = Instant::now() + Duration::from_millis(100);
    let handles = drive(spec, requests, &fleet, &answering, door, start);
    let restart_cleared_after = restart(spec, policy, &kvepps, &answering, start).await;
    let records = collect(spec, requests, handles, start).await;
    let engines = answering.iter().map(|e| e.name.clone()).collect();
    let model = policy.cost_model().unwrap_or(spec.kvepp.router.cost_model);
    if model.predicts() && !kvepps.is_empty() {
        log_learned_ttft(&kvepps[0]).await;
    }
    if let Some(envoy) = envoy {
        envoy.stop().await;
    }
    let mut kvepp_metrics = Vec::new();
    for kvepp in kvepps {
        if let Ok((_, text)) = kvepp_test_support::client::fetch(kvepp.0.metrics, "/metrics").await
        {
            kvepp_metrics.push(text);
        }
        kvepp.stop().await;
    }
    let count = |f: fn(&kvepp_sim::fleet::engine::Counters) -> &std::sync::atomic::AtomicU64| {
        fleet
            .engines
            .iter()
            .map(|e| f(&e.core.counters).load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    };
    let (lora_loads, lora_evictions) = (count(|c| &c.lora_loads), count(|c| &c.lora_evictions));
    drop(fleet);
    Ok(Replay {
        records,
        engines,
        restart_cleared_after,
        lora_loads,
        lora_evictions,
        kvepp_metrics,
    })
}

/// Waits until a router running on its own answers through Envoy and has sent a probe to every
/// engine of the fleet (one-token probes of their own, so no workload prompt is cached by them),
/// or, for a router that never spreads idle probes, 10 s after its first answer.
async fn routes_to_every_engine(
    listener: std::net::SocketAddr,
    fleet: &Fleet,
) -> Result<(), BenchError> {
    let model = &fleet.spec.params.model;
    let mut seen = std::collections::BTreeSet::new();
    let mut first_answer: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut n = 0u32;
    loop {
        n += 1;
        let probe = Request {
            tokens: vec![n, 7, 7, 7],
            max_tokens: 1,
            ..Request::default()
        };
        let answer = client::completion(listener, probe.body(model), None).await;
        if answer.status == 200 {
            first_answer.get_or_insert_with(Instant::now);
            seen.extend(answer.engine);
        }
        let now = Instant::now();
        if seen.len() >= fleet.engines.len()
            || first_answer.is_some_and(|t| now > t + Duration::from_secs(10))
        {
            return Ok(());
        }
        if now > deadline {
            return Err(BenchError::Kvepp(format!(
                "the external router routed no request to the fleet within 60 s ({} engines answered)",
                seen.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The kvepp replicas of a run; with replica sync, each one's peers are the others.
async fn start_replicas(
    spec: &BenchSpec,
    policy: Policy,
    dir: &std::path::Path,
    fleet: &Fleet,
) -> Result<Vec<Kvepp>, BenchError> {
    // Replica sync endpoints on ports free a moment ago; each replica's peers are the others.
    let replicas = spec.replicas.max(1);
    let sync_ports: Vec<u16> = (0..replicas)
        .map(|_| free_port())
        .collect::<Result<_, _>>()?;
    let mut kvepps = Vec::new();
    for i in 0..replicas {
        let mut base = spec.kvepp.clone();
        if spec.replica_sync && replicas > 1 && policy.picker_is_kv_aware() {
            let ep = |p: u16| format!("tcp://127.0.0.1:{p}");
            base.replica_sync.bind = Some(ep(sync_ports[i]));
            base.replica_sync.advertise = Some(ep(sync_ports[i]));
            base.replica_sync.peers = (0..replicas)
                .filter(|&j| j != i)
                .map(|j| ep(sync_ports[j]))
                .collect();
        }
        kvepps.push(
            Kvepp::start(
                &base,
                dir,
                &fleet.spec.pool_name,
                policy,
                spec.params.block_size,
            )
            .await?,
        );
    }
    Ok(kvepps)
}

/// Waits until every replica sees every engine (and its role, and its KV events when used).
async fn wait_ready(spec: &BenchSpec, policy: Policy, kvepps: &[Kvepp]) -> Result<(), BenchError> {
    let n = spec.engines as f64;
    let deadline = Duration::from_secs(30);
    for kvepp in kvepps {
        wait_until("kvepp ready with every engine", deadline, || async {
            (kvepp.metric("kvepp_ready_endpoints").await? >= n).then_some(())
        })
        .await
        .map_err(BenchError::Kvepp)?;
        let roles = spec
            .layout
            .iter()
            .filter(|l| l.role != kvepp_core::Role::Both)
            .count();
        if roles > 0 {
            wait_until(
                "every engine's role from its /metadata",
                deadline,
                || async {
                    let (_, text) =
                        kvepp_test_support::client::fetch(kvepp.0.metrics, "/debug/endpoints")
                            .await
                            .ok()?;
                    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
                    let known = v["endpoints"]
                        .as_array()?
                        .iter()
                        .filter(|e| e["role"] != "both")
                        .count();
                    (known >= roles).then_some(())
                },
            )
            .await
            .map_err(BenchError::Kvepp)?;
        }
        if policy.uses_kv_events() {
            wait_until(
                "KV event subscriptions to every engine",
                deadline,
                || async {
                    (kvepp.metric("kvepp_kv_event_subscriptions").await? >= n).then_some(())
                },
            )
            .await
            .map_err(BenchError::Kvepp)?;
        }
    }
    Ok(())
}

/// Envoy's bootstrap with every replica as an endpoint of the `kvepp` cluster.
fn envoy_bootstrap(kvepps: &[Kvepp]) -> Result<serde_yaml::Value, BenchError> {
    let mut bootstrap = EnvoyProcess::bootstrap()?;
    let more: Vec<std::net::SocketAddr> = kvepps.iter().skip(1).map(|k| k.0.grpc).collect();
    add_ext_proc_endpoints(&mut bootstrap, &more);
    Ok(bootstrap)
}

/// Adds `more` endpoints to the `kvepp` cluster of `bootstrap`, each like its first one.
pub fn add_ext_proc_endpoints(bootstrap: &mut serde_yaml::Value, more: &[std::net::SocketAddr]) {
    let Some(clusters) = bootstrap["static_resources"]["clusters"].as_sequence_mut() else {
        return;
    };
    for c in clusters.iter_mut().filter(|c| c["name"] == "kvepp") {
        let Some(eps) = c["load_assignment"]["endpoints"][0]["lb_endpoints"].as_sequence_mut()
        else {
            continue;
        };
        let Some(first) = eps.first().cloned() else {
            continue;
        };
        for addr in more {
            let mut e = first.clone();
            let sa = &mut e["endpoint"]["address"]["socket_address"];
            sa["address"] = addr.ip().to_string().into();
            sa["port_value"] = addr.port().into();
            eps.push(e);
        }
    }
}

/// Where a replay's requests go.
#[derive(Debug, Clone)]
enum Door {
    /// Envoy's listener (kvepp picks).
    Envoy(std::net::SocketAddr),
    /// Straight to the engine the clairvoyant placement chooses when the request is sent.
    Oracle(std::sync::Arc<oracle::Clairvoyant>),
}

/// Spawns one driver task per request: at its time (or after its previous turn's response),
/// through the door or, for a second client's request, straight to an engine.
fn drive(
    spec: &BenchSpec,
    requests: &[Request],
    fleet: &Fleet,
    answering: &[&kvepp_sim::fleet::SimEngine],
    door: Door,
    start: Instant,
) -> Vec<tokio::task::JoinHandle<Record>> {
    let model = fleet.spec.params.model.clone();
    // A turn waits for the previous one's response.
    let mut done_tx: Vec<Option<oneshot::Sender<()>>> = (0..requests.len()).map(|_| None).collect();
    let mut done_rx: Vec<Option<oneshot::Receiver<()>>> =
        (0..requests.len()).map(|_| None).collect();
    for (j, r) in requests.iter().enumerate() {
        if let Some(i) = r.after.filter(|&i| i < j) {
            let (tx, rx) = oneshot::channel();
            done_tx[i] = Some(tx);
            done_rx[j] = Some(rx);
        }
    }
    let mut handles = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let body = r.body(&model);
        let fixed = match (&door, r.direct) {
            (_, Some(n)) if !answering.is_empty() => Some(answering[n % answering.len()].http),
            (Door::Envoy(listener), _) => Some(*listener),
            (Door::Oracle(_), _) => None,
        };
        // The clairvoyant placement reads the engines when the request leaves, so it needs the
        // prompt then.
        let oracle = match (&door, fixed) {
            (Door::Oracle(o), None) => Some((o.clone(), r.tokens.clone(), u64::from(r.max_tokens))),
            _ => None,
        };
        let at = r.at.div_f64(spec.speed.max(1e-6));
        let (after, done) = (done_rx[i].take(), done_tx[i].take());
        let direct = r.direct.is_some();
        let session = r.session.clone();
        handles.push(tokio::spawn(async move {
            match after {
                Some(previous) => {
                    // A failed previous turn still lets the conversation go on.
                    let _ = previous.await;
                    tokio::time::sleep(at).await;
                }
                None => tokio::time::sleep_until(start + at).await,
            }
            let sent = Instant::now();
            let addr = match &oracle {
                Some((o, tokens, output)) => o.place(tokens, *output),
                None => fixed,
            };
            let outcome = match addr {
                Some(addr) => client::completion(addr, body, session.as_deref()).await,
                None => client::Outcome {
                    error: Some("no engine to place the request on".into()),
                    ..client::Outcome::default()
                },
            };
            if let Some(d) = done {
                let _ = d.send(());
            }
            Record {
                sent: sent.saturating_duration_since(start),
                outcome,
                direct,
            }
        }));
    }
    handles
}

/// With a restart in the spec: restarts the first answering engine at its time; with KV events,
/// how long kvepp took to drop its blocks.
async fn restart(
    spec: &BenchSpec,
    policy: Policy,
    kvepps: &[Kvepp],
    answering: &[&kvepp_sim::fleet::SimEngine],
    start: Instant,
) -> Option<Duration> {
    let mut restart_cleared_after = None;
    if let Some(at) = spec.restart_at {
        if let Some(e) = answering.first() {
            tokio::time::sleep_until(start + at.div_f64(spec.speed.max(1e-6))).await;
            const RESTARTS: &str = "kvepp_kv_event_publisher_restarts_total";
            let seen = if policy.uses_kv_events() {
                Some(kvepps[0].metric(RESTARTS).await.unwrap_or(0.0))
            } else {
                None
            };
            let restarted = Instant::now();
            e.restart();
            if let Some(seen) = seen {
                restart_cleared_after = wait_until(
                    "kvepp to drop the restarted engine's blocks",
                    Duration::from_secs(5),
                    || async {
                        (kvepps[0].metric(RESTARTS).await? > seen).then(|| restarted.elapsed())
                    },
                )
                .await
                .ok();
            }
        }
    }
    restart_cleared_after
}

/// Every request's record, waiting at most the drain time after the last arrival.
async fn collect(
    spec: &BenchSpec,
    requests: &[Request],
    handles: Vec<tokio::task::JoinHandle<Record>>,
    start: Instant,
) -> Vec<Record> {
    let last_arrival = requests
        .iter()
        .filter(|r| r.after.is_none())
        .map(|r| r.at)
        .max()
        .unwrap_or_default()
        .div_f64(spec.speed.max(1e-6));
    tokio::time::sleep_until(start + last_arrival).await;
    let drain_end = Instant::now() + spec.drain;
    let mut records = Vec::with_capacity(handles.len());
    for h in handles {
        let abort = h.abort_handle();
        match tokio::time::timeout_at(drain_end, h).await {
            Ok(Ok(r)) => records.push(r),
            Ok(Err(e)) => records.push(failed(format!("driver task: {e}"))),
            Err(_) => {
                abort.abort();
                records.push(failed(format!(
                    "no response within the drain time {:?}",
                    spec.drain
                )));
            }
        }
    }
    records
}

/// What each endpoint's TTFT model learned (replica 0), in the log.
async fn log_learned_ttft(kvepp: &Kvepp) {
    // What each endpoint's TTFT model learned (replica 0).
    if let Ok((_, text)) =
        kvepp_test_support::client::fetch(kvepp.0.metrics, "/debug/endpoints").await
    {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
            tracing::info!(model = %v["ttft_model"], "learned TTFT model");
            tracing::info!(model = %v["decode_model"], "learned decode model");
            for e in v["endpoints"].as_array().into_iter().flatten() {
                tracing::info!(endpoint = %e["name"], speed = %e["ttft_speed_factor"], "learned speed factor");
            }
        }
    }
}

/// The hit-ratio ceilings of a scenario: unlimited cache, and the fleet's KV capacity.
fn ceilings_of(sc: &scenario::Scenario) -> report::Ceilings {
    let bs = sc.params.block_size as usize;
    let capacity_blocks = sc.params.total_kv_blocks * sc.engines as u64;
    report::Ceilings {
        infinite: workload::hit_ceiling(&sc.requests, bs),
        capacity: workload::hit_ceiling_with_capacity(
            &sc.requests,
            bs,
            usize::try_from(capacity_blocks).unwrap_or(usize::MAX),
        ),
        capacity_blocks,
    }
}

/// The run's spec for a scenario before a policy's own settings.
fn base_spec(sc: &scenario::Scenario, args: &BenchArgs, kvepp: &Config) -> BenchSpec {
    let disaggregated = args.prefill_engines > 0;
    BenchSpec {
        layout: if disaggregated {
            let p = args.prefill_engines.min(sc.engines);
            EngineLayout::disaggregated(p, sc.engines - p, &args.zones)
        } else {
            Vec::new()
        },
        engines: sc.engines,
        params: sc.params.clone(),
        envoy: args.envoy.clone(),
        speed: sc.speed,
        drain: Duration::from_secs_f64(args.drain),
        kvepp: kvepp.clone(),
        replicas: sc.replicas,
        replica_sync: false,
        restart_at: sc.restart_at,
        ips: args.addresses.clone(),
        port: args.port,
    }
}

/// The restart line of a policy: turns of conversations that lived on the restarted engine sent
/// back to it, and when kvepp dropped its blocks.
fn restart_note(
    sc: &scenario::Scenario,
    name: &str,
    policy: Policy,
    (at, engine): (Duration, &String),
    records: &[Record],
    restart_cleared_after: Option<Duration>,
) -> String {
    let at = at.div_f64(sc.speed.max(1e-6));
    let (orphans, back) = orphaned_turns(&sc.requests, records, engine, at);
    let cleared = match (policy.uses_kv_events(), restart_cleared_after) {
        (false, _) => String::new(),
        (true, Some(d)) => format!(
            "; kvepp dropped its blocks {} ms after the restart",
            d.as_millis()
        ),
        (true, None) => "; kvepp had not dropped its blocks 5 s after the restart".into(),
    };
    format!(
        "- {name}: {back} of {orphans} turns whose conversation lived on the restarted engine were sent back to it{cleared}\n"
    )
}

/// Writes `results.md`, `requests.csv`, `results.json` and the chart; returns each workload's
/// results.
#[allow(clippy::type_complexity)]
fn write_outputs(
    args: &BenchArgs,
    all: &[(String, String, report::Ceilings, Vec<PolicyResult>)],
    md: &str,
    csv: &str,
) -> Result<Vec<(String, Vec<PolicyResult>)>, BenchError> {
    let io = |e: std::io::Error| BenchError::Io(e.to_string());
    println!("{md}");
    std::fs::write(args.out.join("results.md"), md).map_err(io)?;
    std::fs::write(args.out.join("requests.csv"), csv).map_err(io)?;
    let json: Vec<serde_json::Value> = all
        .iter()
        .map(|(k, t, c, r)| {
            serde_json::json!({"workload": k, "title": t, "ceilings": c, "results": r})
        })
        .collect();
    let json = serde_json::to_string_pretty(&json).map_err(|e| BenchError::Io(e.to_string()))?;
    std::fs::write(args.out.join("results.json"), json).map_err(io)?;
    let short: Vec<(String, Vec<PolicyResult>)> = all
        .iter()
        .map(|(k, _, _, r)| (k.clone(), r.clone()))
        .collect();
    if let Err(e) = report::chart(&args.out.join("routing.png"), &short) {
        eprintln!("chart not written: {e}");
    }
    Ok(short)
}

fn failed(error: String) -> Record {
    Record {
        sent: Duration::ZERO,
        outcome: client::Outcome {
            error: Some(error),
            ..client::Outcome::default()
        },
        direct: false,
    }
}

/// A port free on 127.0.0.1 a moment ago.
pub fn free_port() -> Result<u16, BenchError> {
    kvepp_test_support::harness::try_free_port().map_err(|e| BenchError::Io(e.to_string()))
}

/// Runs every workload under every policy, prints and writes the results.
pub async fn run(args: BenchArgs) -> Result<Vec<(String, Vec<PolicyResult>)>, BenchError> {
    let io = |e: std::io::Error| BenchError::Io(e.to_string());
    std::fs::create_dir_all(&args.out).map_err(io)?;
    let kvepp = match &args.kvepp_config {
        Some(p) => Config::from_file(p).map_err(|e| BenchError::Kvepp(e.to_string()))?,
        None => Config::default(),
    };
    let mut all = Vec::new();
    let mut md = String::new();
    let mut csv = String::from(report::CSV_HEADER);
    for kind in &args.workload {
        let sc = scenario(*kind, &args)?;
        let ceilings = ceilings_of(&sc);
        eprintln!(
            "== {}: {} requests, hit ceiling {:.1}% (with the fleet's KV capacity {:.1}%)",
            sc.title,
            sc.requests.len(),
            ceilings.infinite * 100.0,
            ceilings.capacity * 100.0
        );
        let disaggregated = args.prefill_engines > 0;
        let spec = base_spec(&sc, &args, &kvepp);
        let modes: Vec<Option<Topology>> = if disaggregated {
            args.topology.iter().copied().map(Some).collect()
        } else {
            vec![None]
        };
        let mut results = Vec::new();
        let mut notes = String::new();
        for (name, grpc) in &args.external {
            let replay = run_router(&spec, Router::External(*grpc), &sc.requests).await?;
            let r = report::summarize(name, &replay.records, &replay.engines, args.slo_ttft_ms);
            report::csv_rows(&mut csv, kind.name(), name, &replay.records);
            eprintln!("   {}", report::line(&r));
            results.push(r);
        }
        let policies = if args.external.is_empty() {
            &args.policy[..]
        } else {
            &[]
        };
        for &policy in policies {
            if policy.reference().is_some() && disaggregated {
                // It places on the engines that answer clients and knows no prefill leg.
                eprintln!(
                    "   {}: not defined for a disaggregated fleet, skipped",
                    policy.name()
                );
                continue;
            }
            let syncs: Vec<Option<bool>> = if sc.replicas > 1 && policy.picker_is_kv_aware() {
                sc.sync.iter().copied().map(Some).collect()
            } else {
                vec![None]
            };
            for (mode, sync) in modes
                .iter()
                .flat_map(|m| syncs.iter().map(move |s| (*m, *s)))
            {
                let mut spec = spec.clone();
                let mut name = policy.name().to_owned();
                if let Some(t) = mode {
                    t.apply(&mut spec.kvepp, args.kv_transfer_weight);
                    name += &format!(" / {}", t.name());
                }
                if let Some(on) = sync {
                    spec.replica_sync = on;
                    if sc.sync.len() > 1 {
                        name += if on { " / sync" } else { " / no sync" };
                    }
                }
                let Replay {
                    records,
                    engines,
                    restart_cleared_after,
                    ..
                } = run_policy(&spec, policy, &sc.requests).await?;
                let r = report::summarize(&name, &records, &engines, args.slo_ttft_ms);
                report::csv_rows(&mut csv, kind.name(), &name, &records);
                eprintln!("   {}", report::line(&r));
                if let (Some(at), Some(engine)) = (sc.restart_at, engines.first()) {
                    let line = restart_note(
                        &sc,
                        &name,
                        policy,
                        (at, engine),
                        &records,
                        restart_cleared_after,
                    );
                    eprint!("   {line}");
                    notes += &line;
                }
                results.push(r);
            }
        }
        md += &report::markdown(&sc.title, ceilings, &results);
        if !notes.is_empty() {
            md += &format!("\n{notes}");
        }
        md.push('\n');
        all.push((kind.name().to_owned(), sc.title, ceilings, results));
    }
    write_outputs(&args, &all, &md, &csv)
}
