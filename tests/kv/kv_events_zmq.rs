//! KV events over real ZMQ: kvepp's subscriber against a pyzmq (libzmq) publisher that behaves like
//! vLLM's, with gaps filled by replay, lost batches, garbage, a restart, and both replay framings.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use kvepp::kv_events::subscriber::run;
use kvepp::kv_events::{Delivery, KvEvent, Source, SubscriberStats, Timing};
use kvepp_test_support::harness::{free_port, DEADLINE};
use kvepp_test_support::publisher::Publisher;
use tokio::sync::{mpsc, watch};

struct Subscriber {
    rx: mpsc::Receiver<Delivery>,
    stats: Arc<SubscriberStats>,
    _stop: watch::Sender<bool>,
}

impl Subscriber {
    fn start(port: u16, replay: Option<u16>) -> Subscriber {
        let (tx, rx) = mpsc::channel(64);
        let stats = Arc::new(SubscriberStats::default());
        let (stop, stopped) = watch::channel(false);
        let source = Source {
            endpoint: format!("tcp://127.0.0.1:{port}"),
            replay_endpoint: replay.map(|r| format!("tcp://127.0.0.1:{r}")),
            topic: String::new(),
        };
        let timing = Timing {
            reconnect_min: Duration::from_millis(20),
            reconnect_max: Duration::from_millis(200),
            replay_timeout: Duration::from_secs(5),
        };
        tokio::spawn(run(source, tx, stats.clone(), timing, stopped));
        Subscriber {
            rx,
            stats,
            _stop: stop,
        }
    }

    async fn next(&mut self) -> Delivery {
        tokio::time::timeout(DEADLINE, self.rx.recv())
            .await
            .expect("a delivery in time")
            .expect("subscriber alive")
    }

    /// Publishes batches seq, seq+1, … until the subscriber has one (ZMQ's slow joiner drops the
    /// first ones; the subscriber replays them), then returns every delivery up to the last one sent.
    async fn join(&mut self, p: &mut Publisher, first: u64, fixture: &str) -> (u64, Vec<Delivery>) {
        let mut seq = first;
        let mut got = Vec::new();
        loop {
            p.cmd(&format!("pub {seq} {fixture}")).await;
            if let Ok(Some(d)) =
                tokio::time::timeout(Duration::from_millis(50), self.rx.recv()).await
            {
                got.push(d);
                break;
            }
            seq += 1;
            assert!(seq < first + 400, "the subscriber never received a batch");
        }
        while !matches!(got.last(), Some(Delivery::Batch { seq: s, .. }) if *s == seq) {
            got.push(self.next().await);
        }
        (seq, got)
    }
}

fn batch_seqs(ds: &[Delivery]) -> Vec<u64> {
    ds.iter()
        .filter_map(|d| {
            if let Delivery::Batch { seq, .. } = d {
                Some(*seq)
            } else {
                None
            }
        })
        .collect()
}

async fn gap_replay_loss_garbage_restart(framing: &str) {
    let (port, replay) = (free_port(), free_port());
    let mut p = Publisher::start(port, replay, framing).await;
    let mut s = Subscriber::start(port, Some(replay));

    // Joining late: whatever the slow joiner missed is replayed, so delivery starts at 0.
    let (last, joined) = s.join(&mut p, 0, "legacy_minimal_arrays").await;
    assert_eq!(
        batch_seqs(&joined),
        (0..=last).collect::<Vec<_>>(),
        "{joined:?}"
    );
    let Delivery::Batch { batch, .. } = &joined[0] else {
        panic!("{joined:?}")
    };
    assert_eq!(batch.events.len(), 3);
    assert!(matches!(batch.events[2], KvEvent::AllCleared));

    // A batch the subscriber never saw, still in the publisher's buffer: replayed, in order.
    p.cmd(&format!("skip {} legacy_batch", last + 1)).await;
    p.cmd(&format!("pub {} map_events", last + 2)).await;
    let (a, b) = (s.next().await, s.next().await);
    assert!(
        matches!(&a, Delivery::Batch { seq, batch, .. } if *seq == last + 1 && batch.data_parallel_rank == Some(1)),
        "{a:?}"
    );
    assert!(
        matches!(&b, Delivery::Batch { seq, batch, .. } if *seq == last + 2 && batch.data_parallel_rank == Some(3)),
        "{b:?}"
    );

    // A batch the publisher no longer has: reported lost, the stream goes on.
    p.cmd(&format!("pub {} legacy_bytes_hashes", last + 4))
        .await;
    assert_eq!(
        s.next().await,
        Delivery::Lost {
            from: last + 3,
            to: last + 4
        }
    );
    assert!(matches!(s.next().await, Delivery::Batch { seq, .. } if seq == last + 4));

    // Garbage is counted, dropped and reported; it still counts as received (no gap, no replay).
    p.cmd(&format!("raw {} c1ffee", last + 5)).await;
    p.cmd(&format!("pub {} map_batch", last + 6)).await;
    assert_eq!(s.next().await, Delivery::Undecodable { seq: last + 5 });
    assert!(matches!(s.next().await, Delivery::Batch { seq, .. } if seq == last + 6));
    assert_eq!(s.stats.undecodable.load(Ordering::Relaxed), 1);
    assert_eq!(s.stats.lost.load(Ordering::Relaxed), 1);

    // The engine restarts on the same ports: its numbering starts over, the subscriber reconnects.
    p.quit().await;
    let mut p = Publisher::start(port, replay, framing).await;
    let (last, after) = s.join(&mut p, 0, "legacy_two_element_batch").await;
    assert_eq!(after[0], Delivery::PublisherRestarted, "{after:?}");
    assert_eq!(
        batch_seqs(&after),
        (0..=last).collect::<Vec<_>>(),
        "{after:?}"
    );
    assert_eq!(s.stats.restarts.load(Ordering::Relaxed), 1);
    p.quit().await;
}

#[tokio::test]
async fn vllm_framing_round_trip() {
    gap_replay_loss_garbage_restart("vllm").await;
}

#[tokio::test]
async fn sglang_framing_round_trip() {
    gap_replay_loss_garbage_restart("sglang").await;
}

#[tokio::test]
async fn without_replay_endpoint_gaps_are_reported_lost() {
    let port = free_port();
    let mut p = Publisher::start(port, free_port(), "vllm").await;
    let mut s = Subscriber::start(port, None);
    let (last, joined) = s.join(&mut p, 0, "legacy_minimal_arrays").await;
    // Whatever the slow joiner missed before `last` cannot be fetched.
    if last > 0 {
        assert_eq!(
            joined[0],
            Delivery::Lost { from: 0, to: last },
            "{joined:?}"
        );
    }
    p.cmd(&format!("pub {} legacy_batch", last + 3)).await;
    assert_eq!(
        s.next().await,
        Delivery::Lost {
            from: last + 1,
            to: last + 3
        }
    );
    assert!(matches!(s.next().await, Delivery::Batch { seq, .. } if seq == last + 3));
    p.quit().await;
}

#[tokio::test]
async fn subscriber_started_before_the_publisher_connects_when_it_appears() {
    let (port, replay) = (free_port(), free_port());
    let mut s = Subscriber::start(port, Some(replay));
    let mut p = Publisher::start(port, replay, "vllm").await;
    let (last, joined) = s.join(&mut p, 0, "map_reordered_keys").await;
    assert_eq!(batch_seqs(&joined), (0..=last).collect::<Vec<_>>());
    p.quit().await;
}

#[tokio::test]
async fn publisher_that_binds_late_publishes_once_and_goes_quiet_is_caught_up() {
    let (port, replay) = (free_port(), free_port());
    let mut s = Subscriber::start(port, Some(replay));
    let mut p = Publisher::start(port, replay, "vllm").await;
    // One batch, right after binding, and then silence: no later batch reveals a gap.
    p.cmd("pub 0 legacy_batch").await;
    assert!(
        matches!(s.next().await, Delivery::Batch { seq: 0, .. }),
        "the batch is delivered without another one following it"
    );
    // A later batch is delivered once, not again as a copy of the catch-up.
    p.cmd("pub 1 legacy_minimal_arrays").await;
    assert!(matches!(s.next().await, Delivery::Batch { seq: 1, .. }));
    assert!(
        tokio::time::timeout(Duration::from_millis(500), s.rx.recv())
            .await
            .is_err(),
        "no duplicate or extra delivery"
    );
    p.quit().await;
}

#[tokio::test]
async fn publisher_without_replay_socket_is_counted_once() {
    let port = free_port();
    let mut p = Publisher::start(port, free_port(), "vllm").await;
    let mut s = Subscriber::start(port, None);
    s.join(&mut p, 0, "legacy_batch").await;
    assert_eq!(s.stats.without_replay.load(Ordering::Relaxed), 1);
    p.quit().await;
}

// ------------------------------------------------------------------ into the index

use kvepp::kv_events::apply::apply_batch;
use kvepp_core::hash::{local_block_hashes, sequence_hashes, LocalBlockHash, SequenceHash};
use kvepp_core::index::reference::ReferenceIndex;
use kvepp_core::index::{EngineBlockHash, PrefixIndex, Tier};
use kvepp_core::slots::WorkerRank;

const BS: usize = 4;
const WORKER: u64 = 7;

/// A random event stream of one engine, kept as the engine would know it: stored chains (engine
/// hashes of its own), their removal, and clears. Also applied to the reference index.
struct Engine {
    rng: fastrand::Rng,
    /// Chains stored so far: (tokens, engine hashes).
    chains: Vec<(Vec<u32>, Vec<u64>)>,
    reference: ReferenceIndex,
}

type WireEvent = (
    &'static str,
    Vec<u64>,
    Option<u64>,
    Vec<u32>,
    u32,
    Option<u32>,
    Option<String>,
);

impl Engine {
    fn rank() -> WorkerRank {
        WorkerRank {
            worker: WORKER,
            dp_rank: 0,
        }
    }

    fn engine_hashes(tokens: &[u32]) -> Vec<u64> {
        let locals = local_block_hashes(tokens, BS, None);
        sequence_hashes(&locals)
            .iter()
            .map(|s| s.0 ^ 0xE16E_0000_0000_0001)
            .collect()
    }

    /// One msgpack batch (legacy arrays) of 1–3 random events, applied to the reference too.
    fn batch(&mut self) -> Vec<u8> {
        let mut events: Vec<WireEvent> = Vec::new();
        for _ in 0..self.rng.usize(1..=3) {
            let r = self.rng.u8(0..20);
            if r < 12 || self.chains.is_empty() {
                let n = self.rng.usize(1..=4) * BS;
                let tokens: Vec<u32> = (0..n).map(|_| self.rng.u32(0..3)).collect();
                let hashes = Self::engine_hashes(&tokens);
                let locals: Vec<LocalBlockHash> = local_block_hashes(&tokens, BS, None);
                let _ = self.reference.store(
                    Self::rank(),
                    Tier::Device,
                    None,
                    hashes.iter().map(|&h| EngineBlockHash(h)).zip(locals),
                );
                events.push((
                    "BlockStored",
                    hashes.clone(),
                    None,
                    tokens.clone(),
                    BS as u32,
                    None,
                    None,
                ));
                self.chains.push((tokens, hashes));
            } else if r < 19 {
                let i = self.rng.usize(..self.chains.len());
                let (_, hashes) = self.chains.swap_remove(i);
                let tail: Vec<u64> = hashes
                    .iter()
                    .rev()
                    .take(self.rng.usize(1..=hashes.len()))
                    .copied()
                    .collect();
                self.reference.remove(
                    Self::rank(),
                    Tier::Device,
                    tail.iter().map(|&h| EngineBlockHash(h)),
                );
                // Removal events carry only hashes; the rest of the tuple is padding for the type.
                events.push(("BlockRemoved", tail, None, Vec::new(), 0, None, None));
            } else {
                self.reference.clear_rank(Self::rank());
                self.chains.clear();
                events.push((
                    "AllBlocksCleared",
                    Vec::new(),
                    None,
                    Vec::new(),
                    0,
                    None,
                    None,
                ));
            }
        }
        encode(&events)
    }
}

/// Legacy tagged arrays, trimmed to each event type's own fields: `[ts, [events...]]`.
fn encode(events: &[WireEvent]) -> Vec<u8> {
    #[derive(serde::Serialize)]
    #[serde(untagged)]
    enum Wire<'a> {
        Stored(&'a WireEvent),
        Removed((&'a str, &'a [u64])),
        Cleared((&'a str,)),
    }
    let wire: Vec<Wire<'_>> = events
        .iter()
        .map(|e| match e.0 {
            "BlockStored" => Wire::Stored(e),
            "BlockRemoved" => Wire::Removed((e.0, &e.1)),
            _ => Wire::Cleared((e.0,)),
        })
        .collect();
    rmp_serde::to_vec(&(1.5f64, wire)).expect("msgpack")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Applies deliveries as kvepp does until batch `last` has been applied.
async fn drain_into(s: &mut Subscriber, index: &mut PrefixIndex, last: u64) {
    drain(s, index, last, false).await
}

async fn drain(s: &mut Subscriber, index: &mut PrefixIndex, last: u64, allow_loss: bool) {
    loop {
        match s.next().await {
            Delivery::Batch { seq, batch, .. } => {
                apply_batch(index, WORKER, 0, BS as u32, &batch);
                if seq == last {
                    return;
                }
            }
            Delivery::PublisherRestarted => index.remove_worker(WORKER),
            Delivery::Lost { from, to } if !allow_loss => {
                panic!("lost {from}..{to}: replay should have filled it")
            }
            // As kvepp does: what the publisher published before is void; what it still holds
            // follows.
            Delivery::Lost { .. } => index.clear_rank(Engine::rank()),
            Delivery::Undecodable { seq } => panic!("batch {seq} did not decode"),
        }
    }
}

fn assert_converged(fast: &PrefixIndex, e: &Engine, rng: &mut fastrand::Rng) {
    let rank = Engine::rank();
    assert_eq!(
        fast.rank_blocks(rank),
        e.reference.rank_blocks(rank),
        "pairs"
    );
    for _ in 0..300 {
        let n = rng.usize(1..=5) * BS;
        let tokens: Vec<u32> = (0..n).map(|_| rng.u32(0..3)).collect();
        let q: Vec<SequenceHash> = sequence_hashes(&local_block_hashes(&tokens, BS, None));
        let mut got = fast.overlaps(&q);
        got.sort_by_key(|o| o.rank);
        assert_eq!(got, e.reference.overlaps(&q), "query {tokens:?}");
    }
}

#[tokio::test]
async fn index_fed_over_zmq_converges_to_the_reference() {
    let (port, replay) = (free_port(), free_port());
    let mut p = Publisher::start(port, replay, "vllm").await;
    let mut s = Subscriber::start(port, Some(replay));
    let mut fast = PrefixIndex::default();
    let mut rng = fastrand::Rng::with_seed(0x6b76_6570);

    // Join with empty batches (the slow joiner's losses are replayed).
    let empty = hex(&encode(&[]));
    let mut seq = 0;
    let first = loop {
        p.cmd(&format!("pubhex {seq} {empty}")).await;
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(50), s.rx.recv()).await {
            break d;
        }
        seq += 1;
    };
    // The first delivery may already be the last batch sent (the subscriber caught up from the
    // replay socket as it connected); otherwise the rest up to it follows.
    match first {
        Delivery::Batch { seq: got, .. } if got == seq => {}
        _ => drain_into(&mut s, &mut fast, seq).await,
    }

    let mut engine = Engine {
        rng: fastrand::Rng::with_seed(7),
        chains: Vec::new(),
        reference: ReferenceIndex::new(u64::MAX),
    };
    // 150 batches; every 7th never reaches the subscriber live and must be replayed.
    for _ in 0..150 {
        seq += 1;
        let cmd = if seq % 7 == 0 { "skiphex" } else { "pubhex" };
        p.cmd(&format!("{cmd} {seq} {}", hex(&engine.batch())))
            .await;
    }
    seq += 1;
    p.cmd(&format!("pubhex {seq} {empty}")).await;
    drain_into(&mut s, &mut fast, seq).await;
    assert!(
        engine.reference.rank_blocks(Engine::rank()) > 0,
        "the stream left blocks"
    );
    assert_converged(&fast, &engine, &mut rng);

    // The engine restarts: everything it held is gone, and its new stream starts at 0.
    p.quit().await;
    engine.reference.remove_worker(WORKER);
    engine.chains.clear();
    let mut p = Publisher::start(port, replay, "vllm").await;
    let mut seq = 0;
    loop {
        p.cmd(&format!("pubhex {seq} {}", hex(&engine.batch())))
            .await;
        if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(50), s.rx.recv()).await {
            assert_eq!(d, Delivery::PublisherRestarted);
            fast.remove_worker(WORKER);
            break;
        }
        seq += 1;
    }
    for _ in 0..40 {
        seq += 1;
        p.cmd(&format!("pubhex {seq} {}", hex(&engine.batch())))
            .await;
    }
    drain_into(&mut s, &mut fast, seq).await;
    assert_converged(&fast, &engine, &mut rng);
    p.quit().await;
}

/// One rank's blocks (with their reference counts) and engine hashes, as dumped.
type RankContent = (
    Vec<(SequenceHash, [u16; 3])>,
    Vec<(EngineBlockHash, SequenceHash)>,
);

/// The blocks and engine hashes `index` holds for the test engine's rank.
fn rank_content(index: &PrefixIndex) -> RankContent {
    index
        .dump()
        .into_iter()
        .find(|d| d.rank == Engine::rank())
        .map(|d| (d.blocks, d.engine))
        .unwrap_or_default()
}

#[tokio::test]
async fn gap_larger_than_the_replay_buffer_rebuilds_from_what_the_publisher_holds() {
    let (port, replay) = (free_port(), free_port());
    let mut p = Publisher::start(port, replay, "vllm").await;
    let mut s = Subscriber::start(port, Some(replay));
    let mut fast = PrefixIndex::default();
    let empty = hex(&encode(&[]));
    let (mut seq, joined) = s.join(&mut p, 0, "legacy_minimal_arrays").await;
    assert!(!joined.is_empty());
    let mut engine = Engine {
        rng: fastrand::Rng::with_seed(11),
        chains: Vec::new(),
        reference: ReferenceIndex::new(u64::MAX),
    };
    let mut sent: Vec<(u64, Vec<u8>)> = Vec::new();
    // Applied live.
    for _ in 0..40 {
        seq += 1;
        let b = engine.batch();
        p.cmd(&format!("pubhex {seq} {}", hex(&b))).await;
        sent.push((seq, b));
    }
    drain_into(&mut s, &mut fast, seq).await;
    let before_gap = rank_content(&fast);
    assert!(!before_gap.0.is_empty(), "the live stream stored blocks");
    // 30 batches the subscriber never sees, then the publisher's buffer keeps only the last 12:
    // 18 batches (and whatever they removed) are gone for good.
    for _ in 0..30 {
        seq += 1;
        let b = engine.batch();
        p.cmd(&format!("skiphex {seq} {}", hex(&b))).await;
        sent.push((seq, b));
    }
    let oldest = seq - 11;
    p.cmd(&format!("evict {oldest}")).await;
    seq += 1;
    p.cmd(&format!("pubhex {seq} {empty}")).await;
    sent.push((seq, encode(&[])));
    drain(&mut s, &mut fast, seq, true).await;
    assert!(s.stats.lost.load(Ordering::Relaxed) >= 18);

    // The reference: only what the publisher still held, applied to an empty index.
    let mut expected = PrefixIndex::default();
    for (_, b) in sent.iter().filter(|(q, _)| *q >= oldest) {
        let batch = kvepp::kv_events::decode::decode_batch(b).unwrap();
        apply_batch(&mut expected, WORKER, 0, BS as u32, &batch);
    }
    let got = rank_content(&fast);
    assert_eq!(got, rank_content(&expected), "index after the loss");
    // Stale entries from before the gap are gone unless a held batch stored them again.
    assert!(
        before_gap.0.iter().any(|b| !got.0.contains(b)),
        "no entry from before the gap was dropped"
    );
    p.quit().await;
}

/// A subscriber that was delivered batches up to `last` by a publisher which then restarted on the
/// same ports: the subscriber, the new publisher, and `last`.
async fn delivered_then_restarted() -> (Subscriber, Publisher, u64) {
    let (port, replay) = (free_port(), free_port());
    let mut p = Publisher::start(port, replay, "vllm").await;
    let mut s = Subscriber::start(port, Some(replay));
    let (joined, _) = s.join(&mut p, 0, "legacy_minimal_arrays").await;
    let last = joined + 1;
    p.cmd(&format!("pub {last} legacy_batch")).await;
    assert!(matches!(s.next().await, Delivery::Batch { seq, .. } if seq == last));
    p.quit().await;
    (s, Publisher::start(port, replay, "vllm").await, last)
}

#[tokio::test]
async fn publisher_restarted_while_away_that_goes_quiet_is_noticed() {
    // The engine restarts, publishes one batch (numbered 0 again) and stays quiet.
    let (mut s, mut p, _) = delivered_then_restarted().await;
    p.cmd("pub 0 legacy_two_element_batch").await;
    let d = s.next().await;
    eprintln!(
        "connects={} {:?}",
        s.stats.connects.load(Ordering::Relaxed),
        d
    );
    assert_eq!(d, Delivery::PublisherRestarted);
    assert!(matches!(s.next().await, Delivery::Batch { seq: 0, .. }));
    p.quit().await;
}

#[tokio::test]
async fn publisher_restarted_while_away_that_numbered_past_the_last_batch_is_noticed() {
    // The new publisher numbers from 0 past the last batch delivered before the subscription
    // reaches it, and goes quiet: its numbers alone read as a continuation with nothing new.
    let (mut s, mut p, last) = delivered_then_restarted().await;
    for seq in 0..=last {
        p.cmd(&format!("skip {seq} legacy_two_element_batch")).await;
    }
    assert_eq!(s.next().await, Delivery::PublisherRestarted);
    let mut replayed = Vec::new();
    while replayed.len() < (last + 1) as usize {
        match s.next().await {
            Delivery::Batch { seq, .. } => replayed.push(seq),
            other => panic!("expected the new publisher's batches, got {other:?}"),
        }
    }
    assert_eq!(replayed, (0..=last).collect::<Vec<_>>());
    assert!(s.stats.restarts.load(Ordering::Relaxed) >= 1);
    p.quit().await;
}
