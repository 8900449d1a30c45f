//! One subscription to a KV-event publisher (a vLLM or SGLang data-parallel rank): a SUB socket for
//! the live stream and, when configured, a DEALER to the publisher's replay ROUTER to fill gaps.
//!
//! Every (re)connect first catches up: the replay socket is asked for everything after the last
//! batch delivered (from 0 for a new publisher), so a publisher that published before we reached it
//! and then went quiet is not missed; once more if no live batch arrives shortly after. A publisher
//! that restarted while we were away is reported restarted and replayed from 0: it holds only
//! numbers below the last one delivered, or its batch of that number is not the one delivered (a
//! fingerprint of the last payload is kept; a new publisher that numbered past it while the
//! subscription was reconnecting shows this way, its sequence alone looking like a continuation).
//!
//! Frames are `[topic, seq (u64 big-endian), payload]`; replay replies end with `seq, payload` (vLLM
//! puts `b"", topic` before them, SGLang and older vLLM only `b""`), and the reply to a request ends
//! with seq `u64::MAX` and an empty payload. Batches are delivered in publisher order, replayed ones
//! included; what cannot be replayed is reported as [`Delivery::Lost`], a restarted publisher as
//! [`Delivery::PublisherRestarted`]. Undecodable payloads are counted, logged, dropped and reported
//! as [`Delivery::Undecodable`] (the consumer no longer knows what the publisher holds). Delivery
//! waits for the consumer (bounded channel): if it falls behind, the publisher's high-water mark
//! drops messages and the gap is replayed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, Socket, SocketEvent, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::decode::{decode_batch, EventBatch};
use super::sequence::{SeqAction, SeqTracker};

/// After a (re)connect, how long to wait for a live batch before catching up once more.
const SETTLE: Duration = Duration::from_millis(300);

/// Sequence number that ends a replay reply.
pub(crate) const REPLAY_END: u64 = u64::MAX;

/// Where one rank publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// e.g. `tcp://10.1.2.3:5557` (vLLM: base port + data-parallel rank).
    pub endpoint: String,
    /// The publisher's replay ROUTER, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix to subscribe to (`""`: everything).
    pub topic: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Delivery {
    Batch {
        seq: u64,
        batch: EventBatch,
        /// When the batch came off the socket (the index's apply lag counts from here).
        received: std::time::Instant,
    },
    /// The publisher restarted: everything it published before is void.
    PublisherRestarted,
    /// Batches `[from, to)` were missed and could not be replayed (a gap larger than the
    /// publisher's replay buffer, or no replay socket). What this publisher delivered before is
    /// unreliable (a lost removal leaves a stale entry): consumers forget its blocks and rebuild
    /// from what follows (the replayed batches the publisher still holds after the gap).
    Lost { from: u64, to: u64 },
    /// Batch `seq` arrived but did not decode (dropped): whatever it changed is unknown.
    /// Consumers stop trusting what this publisher delivered before, until a batch decodes.
    Undecodable { seq: u64 },
}

/// Counters of one subscription (exported as metrics by the caller).
#[derive(Debug, Default)]
pub struct SubscriberStats {
    pub batches: AtomicU64,
    pub replayed: AtomicU64,
    pub undecodable: AtomicU64,
    pub malformed_frames: AtomicU64,
    pub lost: AtomicU64,
    pub restarts: AtomicU64,
    pub connects: AtomicU64,
    /// 1 once the subscription found its publisher has no replay socket (no catch-up possible).
    pub without_replay: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub reconnect_min: Duration,
    pub reconnect_max: Duration,
    /// How long to wait for each replay reply message.
    pub replay_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            reconnect_min: Duration::from_millis(100),
            // Capped low: a publisher that binds late is caught up within about a second.
            reconnect_max: Duration::from_secs(1),
            replay_timeout: Duration::from_secs(2),
        }
    }
}

/// `(seq, payload)` from the last two frames of a message.
fn seq_and_payload(msg: &ZmqMessage) -> Option<(u64, &[u8])> {
    let n = msg.len();
    let seq = msg.get(n.checked_sub(2)?)?;
    let payload = msg.get(n - 1)?;
    Some((
        u64::from_be_bytes(seq.as_ref().try_into().ok()?),
        payload.as_ref(),
    ))
}

struct Subscription {
    source: Source,
    out: mpsc::Sender<Delivery>,
    stats: Arc<SubscriberStats>,
    timing: Timing,
    dealer: Option<DealerSocket>,
    /// The number and payload fingerprint of the last batch delivered: what a catch-up checks
    /// the publisher still holds, to tell a continuation from a new publisher.
    last: Option<(u64, u64)>,
}

/// A payload's fingerprint (SipHash with fixed keys: equal payloads, equal fingerprints).
fn fingerprint(payload: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// Runs until `shutdown` turns true or the consumer goes away.
pub async fn run(
    source: Source,
    out: mpsc::Sender<Delivery>,
    stats: Arc<SubscriberStats>,
    timing: Timing,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut s = Subscription {
        source,
        out,
        stats,
        timing,
        dealer: None,
        last: None,
    };
    let mut tracker = SeqTracker::default();
    let mut told_no_replay = false;
    loop {
        let Some(mut sub) = s.connect(&mut shutdown).await else {
            return;
        };
        // A reconnect may reach a restarted publisher: its replay socket is new too.
        s.dealer = None;
        // Catch up on every (re)connect: whatever the publisher still holds after the last batch
        // applied, so a publisher that published before we reached it and went quiet is indexed.
        if s.source.replay_endpoint.is_some() {
            match s.catch_up(tracker.resume_from()).await {
                None => return,
                Some((from, to)) => tracker.caught_up(from, to, std::time::Instant::now()),
            }
        } else if !told_no_replay {
            told_no_replay = true;
            tracing::warn!(endpoint = %s.source.endpoint, "KV event publisher has no replay socket: batches published before the subscription are not indexed");
            s.stats.without_replay.store(1, Ordering::Relaxed);
        }
        // A batch published while the subscription was still propagating is dropped by the PUB
        // socket (ZMQ's slow joiner) and would be seen only at the next one; if nothing arrives
        // soon after connecting, catch up once more.
        let settle = tokio::time::sleep(SETTLE);
        tokio::pin!(settle);
        let mut settled = s.source.replay_endpoint.is_none();
        // The socket reconnects on its own when the publisher goes away and comes back (an engine
        // restart): each reconnection is a (re)connect like the first, caught up the same way.
        let mut events = sub.monitor();
        let mut monitored = true;
        loop {
            let msg = tokio::select! {
                m = sub.recv() => m,
                ev = events.next(), if monitored => {
                    match ev {
                        None => monitored = false,
                        Some(SocketEvent::Connected(..)) => {
                            s.stats.connects.fetch_add(1, Ordering::Relaxed);
                            tracing::info!(endpoint = %s.source.endpoint, "KV event publisher reconnected");
                            s.dealer = None;
                            if s.source.replay_endpoint.is_some() {
                                match s.catch_up(tracker.resume_from()).await {
                                    None => return,
                                    Some((from, to)) => tracker.caught_up(from, to, std::time::Instant::now()),
                                }
                                settle.as_mut().reset(tokio::time::Instant::now() + SETTLE);
                                settled = false;
                            }
                        }
                        Some(_) => {}
                    }
                    continue;
                }
                _ = &mut settle, if !settled => {
                    settled = true;
                    match s.catch_up(tracker.resume_from()).await {
                        None => return,
                        Some((from, to)) => tracker.caught_up(from, to, std::time::Instant::now()),
                    }
                    continue;
                }
                _ = shutdown.changed() => return,
            };
            settled = true;
            let msg = match msg {
                Ok(m) => m,
                Err(err) => {
                    tracing::warn!(endpoint = %s.source.endpoint, %err, "KV event subscription failed; reconnecting");
                    break;
                }
            };
            let Some((seq, payload)) = seq_and_payload(&msg) else {
                s.stats.malformed_frames.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(endpoint = %s.source.endpoint, frames = msg.len(), "KV event message without seq and payload frames; dropped");
                continue;
            };
            let ok = match tracker.observe(seq, std::time::Instant::now()) {
                SeqAction::Duplicate => continue,
                SeqAction::Deliver => true,
                SeqAction::Replay { from, to } => s.replay(from, to).await,
                SeqAction::Restarted { seq } => {
                    s.stats.restarts.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(endpoint = %s.source.endpoint, seq, "KV event publisher restarted");
                    // Its replay socket is new too: do not ask the old connection.
                    s.dealer = None;
                    s.send(Delivery::PublisherRestarted).await
                        && (seq == 0 || s.replay(0, seq).await)
                }
            };
            if !ok || !s.deliver(seq, payload).await {
                return;
            }
        }
    }
}

impl Subscription {
    /// Connects the SUB socket, retrying with exponential backoff; `None` on shutdown.
    async fn connect(&mut self, shutdown: &mut watch::Receiver<bool>) -> Option<SubSocket> {
        let mut delay = self.timing.reconnect_min;
        loop {
            let mut sub = SubSocket::new();
            let attempt = async {
                sub.connect(&self.source.endpoint).await?;
                sub.subscribe(&self.source.topic).await
            };
            match attempt.await {
                Ok(()) => {
                    self.stats.connects.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(endpoint = %self.source.endpoint, "subscribed to KV events");
                    return Some(sub);
                }
                Err(err) => {
                    tracing::debug!(endpoint = %self.source.endpoint, %err, retry_in = ?delay, "KV event publisher not reachable")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => return None,
            }
            delay = (delay * 2).min(self.timing.reconnect_max);
        }
    }

    /// Sends to the consumer; false when it is gone.
    async fn send(&self, d: Delivery) -> bool {
        self.out.send(d).await.is_ok()
    }

    async fn deliver(&mut self, seq: u64, payload: &[u8]) -> bool {
        let received = std::time::Instant::now();
        self.last = Some((seq, fingerprint(payload)));
        match decode_batch(payload) {
            Ok(batch) => {
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
                self.send(Delivery::Batch {
                    seq,
                    batch,
                    received,
                })
                .await
            }
            Err(err) => {
                self.stats.undecodable.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(endpoint = %self.source.endpoint, seq, %err, "KV event batch dropped");
                self.send(Delivery::Undecodable { seq }).await
            }
        }
    }

    async fn lost(&self, from: u64, to: u64) -> bool {
        self.stats.lost.fetch_add(to - from, Ordering::Relaxed);
        tracing::warn!(endpoint = %self.source.endpoint, from, to, "KV event batches lost");
        self.send(Delivery::Lost { from, to }).await
    }

    /// Fetches `[from, to)` from the replay socket and delivers it in order; what the publisher no
    /// longer has is reported lost. False when the consumer is gone.
    async fn replay(&mut self, from: u64, to: u64) -> bool {
        let got = self.fetch_or_log(from, to, "KV event replay failed").await;
        match self.deliver_replayed(from, got).await {
            Some(expected) => expected >= to || self.lost(expected, to).await,
            None => false,
        }
    }

    /// `fetch`, with a failure logged (when there is a replay socket) and treated as empty.
    async fn fetch_or_log(&mut self, from: u64, to: u64, what: &str) -> Vec<(u64, Vec<u8>)> {
        match self.fetch(from, to).await {
            Ok(got) => got,
            Err(err) => {
                if self.source.replay_endpoint.is_some() {
                    tracing::warn!(endpoint = ?self.source.replay_endpoint, %err, "{what}");
                }
                // A late reply must not be mistaken for the next request's: start a new connection.
                self.dealer = None;
                Vec::new()
            }
        }
    }

    /// Delivers replayed batches (sorted) that should start at `from`, reporting gaps lost.
    /// Returns the batch number expected next, or `None` when the consumer is gone.
    async fn deliver_replayed(&mut self, from: u64, got: Vec<(u64, Vec<u8>)>) -> Option<u64> {
        let mut expected = from;
        for (seq, payload) in got {
            if seq > expected && !self.lost(expected, seq).await {
                return None;
            }
            self.stats.replayed.fetch_add(1, Ordering::Relaxed);
            if !self.deliver(seq, &payload).await {
                return None;
            }
            expected = seq + 1;
        }
        Some(expected)
    }

    /// Replays everything the publisher holds from `from` on and delivers it in order (gaps
    /// reported lost). A publisher restarted while we were away (it numbers from 0 again and may
    /// have gone quiet) when it holds nothing from the last batch applied (`from - 1`) on but
    /// older numbers, or holds that number with another payload: that is reported and everything
    /// it holds is delivered.
    /// Returns the range of numbers delivered (empty when the publisher held nothing new), or
    /// `None` when the consumer is gone. A failed replay is logged and treated as empty.
    async fn catch_up(&mut self, from: u64) -> Option<(u64, u64)> {
        let what = "KV event catch-up failed";
        let mut got = self
            .fetch_or_log(from.saturating_sub(1), REPLAY_END, what)
            .await;
        let replaced = from > 0
            && matches!(self.last, Some((seq, fp)) if seq + 1 == from
                && got.iter().any(|(s, p)| *s == seq && fingerprint(p) != fp));
        if replaced || (from > 0 && got.is_empty() && self.source.replay_endpoint.is_some()) {
            let held = self.fetch_or_log(0, REPLAY_END, what).await;
            if !held.is_empty() {
                self.stats.restarts.fetch_add(1, Ordering::Relaxed);
                tracing::info!(endpoint = %self.source.endpoint, "KV event publisher restarted while disconnected");
                self.last = None;
                if !self.send(Delivery::PublisherRestarted).await {
                    return None;
                }
                let to = self.deliver_replayed(0, held).await?;
                return Some((0, to));
            }
        }
        got.retain(|(seq, _)| *seq >= from);
        let expected = self.deliver_replayed(from, got).await?;
        if expected > from {
            tracing::info!(endpoint = %self.source.endpoint, from, to = expected, "KV events caught up from the replay socket");
        }
        Some((from, expected))
    }

    /// The replayed batches with `from <= seq < to`, sorted, without duplicates.
    async fn fetch(&mut self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        let Some(endpoint) = self.source.replay_endpoint.clone() else {
            return Err("no replay endpoint".into());
        };
        if self.dealer.is_none() {
            let mut d = DealerSocket::new();
            d.connect(&endpoint).await.map_err(|e| e.to_string())?;
            self.dealer = Some(d);
        }
        let Some(dealer) = self.dealer.as_mut() else {
            return Err("no replay socket".into());
        };
        let mut request = ZmqMessage::from(Vec::<u8>::new());
        request.push_back(from.to_be_bytes().to_vec().into());
        dealer.send(request).await.map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        loop {
            let reply = tokio::time::timeout(self.timing.replay_timeout, dealer.recv())
                .await
                .map_err(|_| format!("no replay reply within {:?}", self.timing.replay_timeout))?
                .map_err(|e| e.to_string())?;
            let Some((seq, payload)) = seq_and_payload(&reply) else {
                self.stats.malformed_frames.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            if seq == REPLAY_END {
                break;
            }
            if (from..to).contains(&seq) {
                got.push((seq, payload.to_vec()));
            }
        }
        got.sort_by_key(|(seq, _)| *seq);
        got.dedup_by_key(|(seq, _)| *seq);
        Ok(got)
    }
}
