//! The selection service's HTTP overhead: `/select_and_reserve` + `DELETE /reservations/{id}`
//! pairs per second over HTTP/1.1 keep-alive against the same pick and free called in-process on
//! the same catalog, measured in the same run (the ratio is the figure).
//!
//! Setup: `--workers` single-rank workers in one (model, tenant), their prefix index filled with
//! prefixes of a few prompt families (each worker holds a different length of one family), and
//! requests of `--tokens` tokens that share most of their blocks with a family. Bodies are
//! serialized once before timing; the client reads each answer's `reservation_id`.

use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use kvepp::api::select::SelectState;
use kvepp::replica::peers::SharedPeers;
use kvepp_core::catalog::{Catalog, Limits, PromptRef, Scope, Worker};
use kvepp_core::hash::{sequence_hashes, LocalBlockHash};
use kvepp_core::index::{EngineBlockHash, Tier};
use kvepp_core::slots::WorkerRank;
use kvepp_core::{KvSettings, SequenceHash};

#[derive(Debug, Clone, clap::Args)]
pub struct SelectBenchArgs {
    #[arg(long, default_value_t = 100)]
    pub workers: u64,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 32_768)]
    pub tokens: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5.0)]
    pub seconds: f64,
    /// Concurrent keep-alive connections of the HTTP runs (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub connections: Vec<usize>,
}

const FAMILIES: usize = 8;
const PROMPTS: usize = 64;

/// A catalog of `args.workers` workers with a filled prefix index, and prompts (decoded and as
/// `/select_and_reserve` bodies). Shared with the replica-sync benchmark.
pub(crate) struct Setup {
    pub catalog: Arc<RwLock<Catalog>>,
    pub scope: Scope,
    pub prompts: Vec<Vec<SequenceHash>>,
    pub bodies: Vec<Bytes>,
}

pub(crate) fn setup(args: &SelectBenchArgs) -> anyhow::Result<Setup> {
    let blocks = (args.tokens / args.block_size.max(1) as usize).max(8);
    let mut rng = fastrand::Rng::with_seed(17);
    let scope = Scope {
        model: "bench".into(),
        tenant: "default".into(),
    };
    let mut catalog = Catalog::new(
        KvSettings {
            block_size: args.block_size,
            ..KvSettings::default()
        },
        Limits::default(),
    );
    for w in 0..args.workers {
        catalog.register(
            scope.clone(),
            Worker {
                worker_id: w,
                block_size: args.block_size,
                dp_start: 0,
                dp_size: 1,
                endpoint: Some(format!("http://worker-{w}:8000")),
                kv_events_endpoints: BTreeMap::new(),
                replay_endpoint: None,
            },
        )?;
    }
    let families: Vec<Vec<LocalBlockHash>> = (0..FAMILIES)
        .map(|_| (0..blocks).map(|_| LocalBlockHash(rng.u64(..))).collect())
        .collect();
    {
        let t = catalog.tracker(&scope)?;
        let mut chains = Vec::new();
        for w in 0..args.workers {
            let fam = &families[w as usize % FAMILIES];
            let held = rng.usize(blocks / 8..=blocks * 3 / 4);
            let seqs = sequence_hashes(&fam[..held]);
            let pairs: Vec<_> = seqs
                .iter()
                .zip(&fam[..held])
                .map(|(s, l)| (EngineBlockHash(s.0), *l))
                .collect();
            chains.push((w, pairs));
        }
        t.kv.index().write(|index| {
            for (w, pairs) in &chains {
                index.store(
                    WorkerRank {
                        worker: *w,
                        dp_rank: 0,
                    },
                    Tier::Device,
                    None,
                    pairs.iter().copied(),
                )?;
            }
            Ok::<_, kvepp_core::index::IndexError>(())
        })?;
    }
    let mut prompts = Vec::new();
    let mut bodies = Vec::new();
    for i in 0..PROMPTS {
        let mut locals = families[i % FAMILIES][..blocks * 3 / 4].to_vec();
        locals.extend((locals.len()..blocks).map(|_| LocalBlockHash(rng.u64(..))));
        let seqs = sequence_hashes(&locals);
        let body = serde_json::json!({
            "model_name": scope.model,
            "tenant_id": scope.tenant,
            "sequence_hashes": seqs.iter().map(|h| h.0 as i64).collect::<Vec<_>>(),
            "isl_tokens": args.tokens,
        });
        bodies.push(Bytes::from(serde_json::to_vec(&body)?));
        prompts.push(seqs);
    }
    Ok(Setup {
        catalog: Arc::new(RwLock::new(catalog)),
        scope,
        prompts,
        bodies,
    })
}

/// Pairs per second of pick + book + free called directly on the catalog.
fn in_process(s: &Setup, seconds: f64, isl: u64) -> anyhow::Result<f64> {
    let catalog = s.catalog.read();
    let mut rng = fastrand::Rng::with_seed(3);
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed().as_secs_f64() < seconds {
        let id = format!("bench-{n}");
        let p = &s.prompts[n as usize % s.prompts.len()];
        catalog.select(
            &s.scope,
            PromptRef {
                hashes: p,
                isl_tokens: isl,
            },
            Some((&id, Instant::now())),
            &mut rng,
        )?;
        catalog.free(&id);
        n += 1;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn one_connection(
    addr: SocketAddr,
    bodies: Arc<Vec<Bytes>>,
    offset: usize,
    until: Instant,
) -> anyhow::Result<u64> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut n = 0u64;
    while Instant::now() < until {
        let body = bodies[(offset + n as usize) % bodies.len()].clone();
        let req = hyper::Request::post("/select_and_reserve")
            .header("host", "bench")
            .header("content-type", "application/json")
            .body(Full::new(body))?;
        let resp = send.send_request(req).await?;
        anyhow::ensure!(
            resp.status() == 200,
            "select_and_reserve: {}",
            resp.status()
        );
        let answer = resp.into_body().collect().await?.to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&answer)?;
        let id = v["reservation_id"]
            .as_str()
            .ok_or_else(|| anyhow::anyhow!("no reservation_id"))?;
        let req = hyper::Request::delete(format!("/reservations/{id}"))
            .header("host", "bench")
            .body(Full::new(Bytes::new()))?;
        send.ready().await?;
        let resp = send.send_request(req).await?;
        anyhow::ensure!(resp.status() == 200, "free: {}", resp.status());
        resp.into_body().collect().await?;
        n += 1;
    }
    Ok(n)
}

async fn over_http(
    addr: SocketAddr,
    bodies: &Arc<Vec<Bytes>>,
    connections: usize,
    seconds: f64,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(seconds);
    let tasks: Vec<_> = (0..connections)
        .map(|c| tokio::spawn(one_connection(addr, bodies.clone(), c * 7, until)))
        .collect();
    let mut n = 0;
    for t in tasks {
        n += t.await??;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

pub async fn run(args: SelectBenchArgs) -> anyhow::Result<()> {
    let s = setup(&args)?;
    let state = Arc::new(SelectState::new(
        s.catalog.clone(),
        Arc::new(SharedPeers::default()),
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        axum::serve(
            listener,
            kvepp::api::select::router(state, &Default::default()),
        )
        .await
    });
    let bodies = Arc::new(s.bodies.clone());
    println!(
        "selection service: {} workers, {}-token prompts ({} blocks), {} s per run, {} cores",
        args.workers,
        args.tokens,
        args.tokens / args.block_size as usize,
        args.seconds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // Warm up both paths.
    in_process(&s, 0.2, args.tokens as u64)?;
    over_http(addr, &bodies, 1, 0.2).await?;
    let base = in_process(&s, args.seconds, args.tokens as u64)?;
    println!("| path | connections | pairs/s | in-process ÷ this |");
    println!("|---|---:|---:|---:|");
    println!("| in-process (`Catalog::select` + `free`) | – | {base:.0} | 1.00× |");
    for &c in &args.connections {
        let rate = over_http(addr, &bodies, c.max(1), args.seconds).await?;
        println!(
            "| HTTP keep-alive (`/select_and_reserve` + `DELETE /reservations/{{id}}`) | {c} | {rate:.0} | {:.2}× |",
            base / rate.max(f64::MIN_POSITIVE)
        );
    }
    server.abort();
    Ok(())
}
