//! `kvepp-bench bench-rollout`: a rolling upgrade under load. Two `kvepp serve` processes (the
//! binary given, replica sync between them, each recovering the index from the other on start)
//! behind one Envoy with the shipped bootstrap (fail-close, the `kvepp` cluster health-checked), a
//! simulated fleet publishing KV events, and a steady open-loop load of shared-prefix requests.
//! After a warm-up and a window of normal service, each replica in turn gets SIGTERM, exits, is
//! started again and becomes healthy in Envoy's eyes before the next one goes; `rounds` times.
//! Then a second window.
//!
//! Printed: requests sent and failed, the longest time to first token while replicas restarted
//! (the stall a client saw) against before, and the prefix-cache hit ratio the engines reported
//! in the window before and the window after the rollout (the index came back from the peer if
//! they match).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::time::Instant;

use kvepp_sim::client::{completion, Outcome};
use kvepp_sim::fleet::{Fleet, FleetSpec, SimParams};
use kvepp_sim::workload::{shared_prefix, SharedPrefix};
use kvepp_test_support::client::fetch;
use kvepp_test_support::envoy::EnvoyProcess;
use kvepp_test_support::{wait_until, TempDir};

#[derive(Debug, Clone, clap::Args)]
pub struct RolloutArgs {
    /// The Envoy binary.
    #[arg(long, env = "ENVOY_BIN")]
    pub envoy: PathBuf,
    /// The `kvepp` binary the replicas run.
    #[arg(long)]
    pub kvepp: PathBuf,
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Requests per second (Poisson arrivals).
    #[arg(long, default_value_t = 8.0)]
    pub rate: f64,
    /// Load before the first measured window.
    #[arg(long, default_value_t = 20)]
    pub warmup_seconds: u64,
    /// The measured windows before and after the rollout.
    #[arg(long, default_value_t = 60)]
    pub window_seconds: u64,
    /// Times both replicas are restarted, one after the other.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// The replicas' `shutdown_delay_ms` (above the health check's interval + timeout).
    #[arg(long, default_value_t = 3000)]
    pub shutdown_delay_ms: u64,
    /// System prompts the requests share.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Directory for `rollout.md`.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("{0}")]
    Setup(String),
    #[error("replica {replica}: {message}")]
    Replica { replica: usize, message: String },
}

fn setup(e: impl std::fmt::Display) -> RolloutError {
    RolloutError::Setup(e.to_string())
}

/// What one phase of the run saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Phase {
    pub requests: usize,
    pub failed: usize,
    pub ttft_p50_ms: f64,
    pub ttft_max_ms: f64,
    /// Cached prompt tokens over prompt tokens, as the engines reported them.
    pub hit_ratio: f64,
}

/// The run's figures.
#[derive(Debug, Clone, Default)]
pub struct RolloutReport {
    pub sent: usize,
    pub failed: usize,
    /// The first few failures, for the log.
    pub errors: Vec<String>,
    pub before: Phase,
    pub during: Phase,
    pub after: Phase,
    /// Each restart: replica, SIGTERM → exited, SIGTERM → healthy in Envoy.
    pub restarts: Vec<(usize, Duration, Duration)>,
}

/// One `kvepp serve` process on fixed ports (a restart takes the same ones).
struct Replica {
    index: usize,
    config: PathBuf,
    log: PathBuf,
    grpc: SocketAddr,
    metrics: SocketAddr,
    child: Option<Child>,
}

impl Replica {
    /// Writes replica `i`'s configuration: its ports, replica sync with `peer`, and index recovery
    /// from `peer`'s metrics port.
    fn configure(
        i: usize,
        dir: &Path,
        manifests: &Path,
        ports: &[[u16; 4]; 2],
        args: &RolloutArgs,
        block_size: u32,
    ) -> Result<Replica, RolloutError> {
        let [grpc, health, metrics, sync] = ports[i];
        let peer = ports[1 - i];
        let yaml = format!(
            "pool_name: sim-pool\nmanifests_dir: {}\nmanifests_poll_ms: 100\n\
             bind_address: 127.0.0.1\ngrpc_port: {grpc}\ngrpc_health_port: {health}\n\
             metrics_port: {metrics}\nblock_size: {block_size}\nlog_level: warn\n\
             shutdown_delay_ms: {}\nshutdown_grace_seconds: 10\n\
             replica_sync:\n  bind: tcp://127.0.0.1:{sync}\n  advertise: tcp://127.0.0.1:{sync}\n\
             \x20 peers: [tcp://127.0.0.1:{}]\n  indexer_peers: [http://127.0.0.1:{}]\n",
            manifests.display(),
            args.shutdown_delay_ms,
            peer[3],
            peer[2],
        );
        let config = dir.join(format!("kvepp-{i}.yaml"));
        std::fs::write(&config, yaml).map_err(setup)?;
        Ok(Replica {
            index: i,
            config,
            log: dir.join(format!("kvepp-{i}.log")),
            grpc: ([127, 0, 0, 1], grpc).into(),
            metrics: ([127, 0, 0, 1], metrics).into(),
            child: None,
        })
    }

    fn spawn(&mut self, bin: &Path) -> Result<(), RolloutError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(setup)?;
        let child = Command::new(bin)
            .args(["serve", "--config"])
            .arg(&self.config)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| setup(format!("cannot run {}: {e}", bin.display())))?;
        self.child = Some(child);
        Ok(())
    }

    fn fail(&self, message: impl std::fmt::Display) -> RolloutError {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: String = log
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        RolloutError::Replica {
            replica: self.index,
            message: format!("{message}; log:\n{tail}"),
        }
    }

    /// Waits for `/ready`; a process that exits first fails at once.
    async fn ready(&mut self) -> Result<(), RolloutError> {
        let addr = self.metrics;
        let child = std::sync::Mutex::new(self.child.as_mut());
        let ready = wait_until("kvepp ready", Duration::from_secs(60), || async {
            let exited = child
                .lock()
                .ok()
                .and_then(|mut c| c.as_mut().and_then(|c| c.try_wait().ok().flatten()));
            if let Some(status) = exited {
                return Some(Err(format!("exited before it was ready ({status})")));
            }
            matches!(fetch(addr, "/ready").await, Ok((200, _))).then_some(Ok(()))
        })
        .await;
        match ready {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) | Err(e) => Err(self.fail(e)),
        }
    }

    /// Waits until Envoy (admin at `admin`) sees this replica pass its health check.
    async fn healthy_in(&self, admin: SocketAddr) -> Result<(), RolloutError> {
        let grpc = self.grpc;
        wait_until("healthy in Envoy", Duration::from_secs(30), || async move {
            healthy_in_envoy(admin, grpc).await.then_some(())
        })
        .await
        .map_err(|e| self.fail(e))
    }

    /// SIGTERM, then waits for the process to exit (within its delay and grace).
    async fn terminate(&mut self) -> Result<(), RolloutError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id().ok_or_else(|| self.fail("no pid"))?;
        let killed = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .map_err(setup)?;
        if !killed.success() {
            return Err(self.fail("kill -TERM failed"));
        }
        let exited = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
        match exited {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(self.fail(format!("exited with {status}"))),
            Ok(Err(e)) => Err(self.fail(e)),
            Err(_) => Err(self.fail("still running 60 s after SIGTERM")),
        }
    }
}

/// Whether Envoy's admin says `endpoint` of the `kvepp` cluster passes its health check.
async fn healthy_in_envoy(admin: SocketAddr, endpoint: SocketAddr) -> bool {
    let Ok((_, text)) = fetch(admin, "/clusters").await else {
        return false;
    };
    let key = format!("kvepp::{endpoint}::health_flags::");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .is_some_and(|flags| flags.trim() == "healthy")
}

/// The shipped bootstrap with both replicas as endpoints of the `kvepp` cluster.
fn bootstrap(replicas: &[Replica]) -> Result<serde_yaml::Value, RolloutError> {
    let addrs: Vec<SocketAddr> = replicas.iter().map(|r| r.grpc).collect();
    let mut b = EnvoyProcess::bootstrap().map_err(setup)?;
    crate::routing::add_ext_proc_endpoints(&mut b, &addrs[1..]);
    Ok(b)
}

/// A request's fate, with when it left (from the start of the load).
type Sent = (Duration, Outcome);

/// Sends the workload open-loop to `envoy` until `stop`.
fn drive(
    envoy: SocketAddr,
    args: &RolloutArgs,
    model: String,
    stop: tokio::sync::watch::Receiver<bool>,
) -> (Arc<Mutex<Vec<Sent>>>, tokio::task::JoinHandle<()>) {
    let requests = shared_prefix(&SharedPrefix {
        groups: args.groups,
        system_tokens: 1024,
        user_tokens: 64,
        output_tokens: (8, 32),
        rate: args.rate,
        // Long enough for any rollout; the load stops when the last window ends.
        duration: Duration::from_secs(args.warmup_seconds + 2 * args.window_seconds + 600),
        seed: args.seed,
    });
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    let driver = tokio::spawn(async move {
        let start = Instant::now();
        let mut inflight = tokio::task::JoinSet::new();
        for r in requests {
            tokio::time::sleep_until(start + r.at).await;
            if *stop.borrow() {
                break;
            }
            let (sink, body) = (sink.clone(), r.body(&model));
            inflight.spawn(async move {
                let at = start.elapsed();
                let outcome = completion(envoy, body, None).await;
                if let Ok(mut l) = sink.lock() {
                    l.push((at, outcome));
                }
            });
        }
        while inflight.join_next().await.is_some() {}
    });
    (log, driver)
}

fn phase(sent: &[Sent], from: Duration, to: Duration) -> Phase {
    let mut in_phase: Vec<&Outcome> = sent
        .iter()
        .filter(|(at, _)| *at >= from && *at < to)
        .map(|(_, o)| o)
        .collect();
    let mut ttft: Vec<f64> = in_phase
        .iter()
        .filter_map(|o| o.ttft.map(|t| t.as_secs_f64() * 1000.0))
        .collect();
    ttft.sort_by(f64::total_cmp);
    let (prompt, cached) = in_phase
        .iter()
        .filter(|o| o.error.is_none())
        .fold((0u64, 0u64), |(p, c), o| {
            (p + o.prompt_tokens, c + o.cached_tokens)
        });
    let failed = in_phase.iter().filter(|o| o.error.is_some()).count();
    let requests = in_phase.len();
    in_phase.clear();
    Phase {
        requests,
        failed,
        ttft_p50_ms: ttft.get(ttft.len() / 2).copied().unwrap_or(0.0),
        ttft_max_ms: ttft.last().copied().unwrap_or(0.0),
        hit_ratio: if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        },
    }
}

/// Restarts each replica in turn, `rounds` times; each must be healthy in Envoy before the next
/// goes. Returns each restart's times.
async fn roll(
    replicas: &mut [Replica],
    args: &RolloutArgs,
    admin: SocketAddr,
) -> Result<Vec<(usize, Duration, Duration)>, RolloutError> {
    let mut restarts = Vec::new();
    for _ in 0..args.rounds {
        for r in replicas.iter_mut() {
            let t = Instant::now();
            r.terminate().await?;
            let exited = t.elapsed();
            r.spawn(&args.kvepp)?;
            r.ready().await?;
            r.healthy_in(admin).await?;
            restarts.push((r.index, exited, t.elapsed()));
        }
    }
    Ok(restarts)
}

/// Runs the rolling upgrade; `dir` keeps the replicas' configuration and logs.
pub async fn rollout(args: &RolloutArgs, dir: &Path) -> Result<RolloutReport, RolloutError> {
    let params = SimParams::default();
    let fleet = Fleet::start(FleetSpec {
        engines: args.engines,
        params: params.clone(),
        ..FleetSpec::default()
    })
    .await
    .map_err(setup)?;
    let manifests = dir.join("manifests");
    std::fs::create_dir_all(&manifests).map_err(setup)?;
    fleet.write_manifests(&manifests).map_err(setup)?;
    let mut ports = [[0u16; 4]; 2];
    for p in ports.iter_mut().flatten() {
        *p = crate::routing::free_port().map_err(setup)?;
    }
    let mut replicas = vec![
        Replica::configure(0, dir, &manifests, &ports, args, params.block_size)?,
        Replica::configure(1, dir, &manifests, &ports, args, params.block_size)?,
    ];
    for r in replicas.iter_mut() {
        r.spawn(&args.kvepp)?;
    }
    for r in replicas.iter_mut() {
        r.ready().await?;
    }
    let envoy = EnvoyProcess::start_with(&args.envoy, bootstrap(&replicas)?, replicas[0].grpc)
        .await
        .map_err(setup)?;
    for r in &replicas {
        r.healthy_in(envoy.admin).await?;
    }
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let started = Instant::now();
    let (log, driver) = drive(envoy.listener, args, params.model.clone(), stop);
    let (warmup, window) = (
        Duration::from_secs(args.warmup_seconds),
        Duration::from_secs(args.window_seconds),
    );
    tokio::time::sleep_until(started + warmup + window).await;
    let roll_start = started.elapsed();
    let restarts = roll(&mut replicas, args, envoy.admin).await;
    let roll_end = started.elapsed();
    if restarts.is_ok() {
        tokio::time::sleep_until(started + roll_end + window).await;
    }
    let _ = stop_tx.send(true);
    let _ = driver.await;
    envoy.stop().await;
    let restarts = restarts?;
    let sent = log.lock().map(|l| l.clone()).unwrap_or_default();
    let errors = sent
        .iter()
        .filter_map(|(_, o)| o.error.clone())
        .take(5)
        .collect();
    Ok(RolloutReport {
        sent: sent.len(),
        failed: sent.iter().filter(|(_, o)| o.error.is_some()).count(),
        errors,
        before: phase(&sent, warmup, warmup + window),
        during: phase(&sent, roll_start, roll_end),
        after: phase(&sent, roll_end, roll_end + window),
        restarts,
    })
}

/// The report as a Markdown table.
pub fn table(args: &RolloutArgs, r: &RolloutReport) -> String {
    let mut out = format!(
        "Rolling upgrade: 2 kvepp replicas restarted one after the other, {} round(s); {} engines, \
         {} req/s, shutdown_delay_ms {}\n\n\
         requests sent: {}, failed: {}\n\n\
         | phase | requests | failed | TTFT p50 ms | TTFT max ms (longest stall) | prefix hit ratio |\n\
         |---|---|---|---|---|---|\n",
        args.rounds, args.engines, args.rate, args.shutdown_delay_ms, r.sent, r.failed
    );
    for (name, p) in [
        (format!("{} s before", args.window_seconds), &r.before),
        ("during the rollout".to_owned(), &r.during),
        (format!("{} s after", args.window_seconds), &r.after),
    ] {
        out += &format!(
            "| {name} | {} | {} | {:.0} | {:.0} | {:.1}% |\n",
            p.requests,
            p.failed,
            p.ttft_p50_ms,
            p.ttft_max_ms,
            100.0 * p.hit_ratio
        );
    }
    out += &format!(
        "\nhit ratio after − before: {:+.1} points\n\nrestarts (replica: SIGTERM → exited, → healthy in Envoy):\n",
        100.0 * (r.after.hit_ratio - r.before.hit_ratio)
    );
    for (i, exited, healthy) in &r.restarts {
        out += &format!(
            "- replica {i}: {:.1} s, {:.1} s\n",
            exited.as_secs_f64(),
            healthy.as_secs_f64()
        );
    }
    for e in &r.errors {
        out += &format!("- failure: {e}\n");
    }
    out
}

/// `kvepp-bench bench-rollout`: the replicas' configuration and logs in a temporary directory (kept
/// only when the run fails, named in the error), the table printed and written to
/// `<out>/rollout.md`.
pub async fn run(args: RolloutArgs) -> Result<(), RolloutError> {
    let work = TempDir::new("rollout");
    let report = rollout(&args, work.path()).await?;
    let text = table(&args, &report);
    print!("{text}");
    if let Some(d) = &args.out {
        std::fs::create_dir_all(d).map_err(setup)?;
        std::fs::write(d.join("rollout.md"), &text).map_err(setup)?;
    }
    Ok(())
}
