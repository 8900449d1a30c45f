//! An engine's KV events, as vLLM publishes them: msgpack batches `[ts, [events], dp_rank]` with
//! legacy tagged-array events on a ZMQ PUB socket (frames `topic, seq BE8, payload`), the last
//! batches kept for a replay ROUTER (a DEALER sends `["", start_seq BE8]`; the reply is
//! `["", topic, seq, payload]` per batch from `start_seq`, then `["", "", 0xFF×8, ""]`). A batch
//! that starts with [`CacheEvent::Cleared`] (an engine restart) is numbered 0 again, as a new
//! publisher's first would be, with an empty replay buffer.

use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::cache::CacheEvent;

/// Batches kept for replay (vLLM's `buffer_steps` default).
pub const REPLAY_BUFFER: usize = 10_000;

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Where an engine publishes.
#[derive(Debug, Clone)]
pub struct Publisher {
    pub endpoint: String,
    pub replay_endpoint: String,
}

#[derive(Debug, thiserror::Error)]
#[error("cannot bind {what} on {addr}: {source}")]
pub struct BindError {
    what: &'static str,
    addr: String,
    source: zeromq::ZmqError,
}

/// One vLLM batch, msgpack-encoded (legacy tagged arrays, medium "GPU", data-parallel rank 0).
pub fn encode_batch(ts: f64, events: &[CacheEvent], block_size: u32) -> Vec<u8> {
    #[derive(serde::Serialize)]
    #[serde(untagged)]
    enum Wire<'a> {
        Stored(
            &'static str,
            &'a [u64],
            Option<u64>,
            &'a [u32],
            u32,
            Option<u32>,
            &'static str,
            Option<&'a str>,
        ),
        Removed(&'static str, &'a [u64], &'static str),
        Cleared((&'static str,)),
    }
    let wire: Vec<Wire<'_>> = events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored {
                parent,
                hashes,
                token_ids,
                lora,
            } => Wire::Stored(
                "BlockStored",
                hashes,
                *parent,
                token_ids,
                block_size,
                lora.as_ref().map(|_| 1),
                "GPU",
                lora.as_deref(),
            ),
            CacheEvent::Removed { hashes } => Wire::Removed("BlockRemoved", hashes, "GPU"),
            CacheEvent::Cleared => Wire::Cleared(("AllBlocksCleared",)),
        })
        .collect();
    // Serializing plain arrays of numbers and strings cannot fail.
    rmp_serde::to_vec(&(ts, wire, 0u32)).unwrap_or_default()
}

/// Binds the PUB and replay ROUTER sockets on `ip` (ephemeral ports) and publishes every batch
/// of `events` until the channel closes.
pub async fn start(
    ip: std::net::IpAddr,
    topic: String,
    block_size: u32,
    mut events: mpsc::UnboundedReceiver<Vec<CacheEvent>>,
) -> Result<Publisher, BindError> {
    let bind = |what: &'static str, source| BindError {
        what,
        addr: ip.to_string(),
        source,
    };
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind(&format!("tcp://{ip}:0"))
        .await
        .map_err(|e| bind("PUB socket", e))?
        .to_string();
    let mut router = RouterSocket::new();
    let replay_endpoint = router
        .bind(&format!("tcp://{ip}:0"))
        .await
        .map_err(|e| bind("replay ROUTER socket", e))?
        .to_string();
    let buffer: Buffer = Arc::default();
    let topic = Bytes::from(topic);

    let buf = buffer.clone();
    let t = topic.clone();
    tokio::spawn(async move {
        let mut seq = 0u64;
        while let Some(batch) = events.recv().await {
            if batch.first() == Some(&CacheEvent::Cleared) {
                // A restarted engine is a new publisher: numbers from 0, nothing to replay.
                seq = 0;
                buf.lock().clear();
            }
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            let payload = Bytes::from(encode_batch(ts, &batch, block_size));
            {
                let mut b = buf.lock();
                b.push_back((seq, payload.clone()));
                if b.len() > REPLAY_BUFFER {
                    b.pop_front();
                }
            }
            let mut m = ZmqMessage::from(t.clone());
            m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            m.push_back(payload);
            if let Err(e) = publisher.send(m).await {
                tracing::warn!(%e, "KV event publish failed");
            }
            seq += 1;
        }
    });
    tokio::spawn(async move {
        loop {
            let req = match router.recv().await {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(%e, "replay socket closed");
                    return;
                }
            };
            let frames: Vec<Bytes> = req.into_vec();
            let (Some(peer), Some(start)) = (frames.first(), frames.last()) else {
                continue;
            };
            let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
                tracing::warn!("replay request without an 8-byte start sequence");
                continue;
            };
            let batches: Vec<(u64, Bytes)> = buffer
                .lock()
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect();
            let reply = |frames: [Bytes; 4]| {
                let mut m = ZmqMessage::from(peer.clone());
                for f in frames {
                    m.push_back(f);
                }
                m
            };
            for (s, payload) in batches {
                let m = reply([
                    Bytes::new(),
                    topic.clone(),
                    Bytes::copy_from_slice(&s.to_be_bytes()),
                    payload,
                ]);
                if router.send(m).await.is_err() {
                    break;
                }
            }
            let end = reply([
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
                Bytes::new(),
            ]);
            let _ = router.send(end).await;
        }
    });
    Ok(Publisher {
        endpoint,
        replay_endpoint,
    })
}
