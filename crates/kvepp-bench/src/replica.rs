//! Replica sync's cost to the replica receiving it: picks (select + atomic booking + free on the
//! catalog, as `/select_and_reserve` runs them) measured alone, then while 3 peers publish
//! lifecycle events at a fixed rate, then while one peer publishes as fast as it can (the event
//! rate one replica absorbs while serving picks). Real ZMQ PUB sockets on 127.0.0.1 feed the real
//! replica-sync subscriber and sink; all in one run, so the figures compare.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use prost::Message;
use tokio::sync::watch;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use kvepp::replica::sink::{CatalogSink, Ids};
use kvepp::replica::{wire, SyncStats, WIRE_VERSION};
use kvepp_core::catalog::PromptRef;

use crate::select::{setup, SelectBenchArgs};

#[derive(Debug, Clone, clap::Args)]
pub struct ReplicaBenchArgs {
    #[arg(long, default_value_t = 100)]
    pub workers: u64,
    /// Prompt length in tokens (picks and replicated admissions).
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Admission + free pairs per second each of the 3 peers publishes in the paced run.
    #[arg(long, default_value_t = 1000)]
    pub pairs_per_peer: u32,
}

/// One peer: a PUB socket sending admission/free pairs for the catalog's workers.
async fn peer(
    socket: PubSocket,
    origin: u64,
    args: ReplicaBenchArgs,
    prompts: Arc<Vec<Vec<u64>>>,
    pairs_per_second: Option<u32>,
    mut stop: watch::Receiver<bool>,
) {
    let mut socket = socket;
    let mut n: u64 = 0;
    // Paced in 1 ms ticks; unpaced: as fast as the socket takes them.
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let per_tick = pairs_per_second.map(|r| (r / 1000).max(1));
    loop {
        if *stop.borrow() {
            return;
        }
        let burst = match per_tick {
            Some(k) => {
                tokio::select! { _ = tick.tick() => {}, _ = stop.changed() => return }
                k
            }
            None => 64,
        };
        for _ in 0..burst {
            let id = format!("peer{origin}-{n}");
            let env = |event| wire::Envelope {
                version: WIRE_VERSION,
                origin,
                model_name: "bench".into(),
                tenant_id: "default".into(),
                event: Some(event),
            };
            let admission = env(wire::envelope::Event::Admission(wire::Admission {
                request_id: id.clone(),
                worker_id: n % args.workers,
                dp_rank: 0,
                block_size: 16,
                sequence_hashes: prompts[n as usize % prompts.len()].clone(),
                prefill_tokens: args.tokens as u64,
            }));
            let free = env(wire::envelope::Event::Free(wire::Free { request_id: id }));
            for e in [admission, free] {
                let msg = ZmqMessage::from(Bytes::from(e.encode_to_vec()));
                if socket.send(msg).await.is_err() {
                    return;
                }
            }
            n += 1;
        }
        if per_tick.is_none() {
            tokio::task::yield_now().await;
        }
    }
}

struct Run {
    picks_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    applied_per_s: f64,
}

pub async fn run(args: ReplicaBenchArgs) -> anyhow::Result<()> {
    let sel = SelectBenchArgs {
        workers: args.workers,
        tokens: args.tokens,
        block_size: 16,
        seconds: args.seconds,
        connections: vec![],
    };
    let s = Arc::new(setup(&sel)?);
    let prompts: Arc<Vec<Vec<u64>>> = Arc::new(
        s.prompts
            .iter()
            .map(|p| p.iter().map(|h| h.0).collect())
            .collect(),
    );
    println!(
        "replica sync: {} workers, {}-token prompts, {} s per run, {} cores",
        args.workers,
        args.tokens,
        args.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| peers publishing | picks/s | pick p50 (µs) | pick p99 (µs) | events applied/s |");
    println!("|---|---:|---:|---:|---:|");
    for (label, peers, rate) in [
        ("0", 0usize, None),
        ("3, paced", 3, Some(args.pairs_per_peer)),
        ("1, unpaced", 1, None),
    ] {
        let r = measure(&s, &args, &prompts, peers, rate).await?;
        let rate_txt = rate.map_or(String::new(), |r| format!(" ({} pairs/s each)", r));
        println!(
            "| {label}{rate_txt} | {:.0} | {:.1} | {:.1} | {:.0} |",
            r.picks_per_s, r.p50_us, r.p99_us, r.applied_per_s
        );
    }
    Ok(())
}

async fn measure(
    s: &Arc<crate::select::Setup>,
    args: &ReplicaBenchArgs,
    prompts: &Arc<Vec<Vec<u64>>>,
    peers: usize,
    rate: Option<u32>,
) -> anyhow::Result<Run> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut endpoints = Vec::new();
    for p in 0..peers {
        let mut socket = PubSocket::new();
        let ep = socket.bind("tcp://127.0.0.1:0").await?.to_string();
        endpoints.push(ep);
        tokio::spawn(peer(
            socket,
            1000 + p as u64,
            args.clone(),
            prompts.clone(),
            rate,
            stop_rx.clone(),
        ));
    }
    let stats = Arc::new(SyncStats::default());
    let (_peers_tx, peers_rx) = watch::channel(endpoints);
    let sink = Arc::new(CatalogSink {
        catalog: s.catalog.clone(),
        ids: Ids::Global,
    });
    tokio::spawn(kvepp::replica::run_subscribers(
        peers_rx,
        7,
        sink,
        stats.clone(),
        stop_rx.clone(),
    ));
    if peers > 0 {
        let deadline = Instant::now() + Duration::from_secs(10);
        while stats.get("applied") == 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::ensure!(stats.get("applied") > 0, "no replica event arrived");
    }
    let applied_before = stats.get("applied");
    let setup = s.clone();
    let seconds = args.seconds;
    let isl = args.tokens as u64;
    let (picks, durations) = tokio::task::spawn_blocking(move || {
        let catalog = setup.catalog.read();
        let mut rng = fastrand::Rng::with_seed(3);
        let mut durations = Vec::new();
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed().as_secs_f64() < seconds {
            let id = format!("local-{n}");
            let p = &setup.prompts[n as usize % setup.prompts.len()];
            let t = Instant::now();
            catalog.select(
                &setup.scope,
                PromptRef {
                    hashes: p,
                    isl_tokens: isl,
                },
                Some((&id, Instant::now())),
                &mut rng,
            )?;
            durations.push(t.elapsed());
            catalog.free(&id);
            n += 1;
        }
        anyhow::Ok((n as f64 / start.elapsed().as_secs_f64(), durations))
    })
    .await??;
    let applied = stats.get("applied") - applied_before;
    let _ = stop_tx.send(true);
    let mut d = durations;
    d.sort_unstable();
    let q = |f: f64| d[((d.len() as f64 * f) as usize).min(d.len() - 1)].as_secs_f64() * 1e6;
    Ok(Run {
        picks_per_s: picks,
        p50_us: q(0.5),
        p99_us: q(0.99),
        applied_per_s: applied as f64 / args.seconds,
    })
}
