//! vLLM KV-cache events: what engines publish about the blocks they store and evict.
//!
//! [`decode`] turns one ZMQ payload frame (a msgpack batch) into typed events. It accepts every
//! encoding vLLM and SGLang use: array batches with or without the data-parallel rank and map
//! batches; legacy tagged-array events with trailing defaults omitted and newer `{"type": ...}` map
//! events in any key order; block hashes as u64, negative i64, or 32-byte binaries. Unknown fields,
//! trailing elements and event types are ignored; anything else malformed rejects the whole batch,
//! so a bad message never half-applies.

//!
//! [`subscriber`] is the transport: one SUB socket per publisher rank, sequence tracking
//! ([`sequence`]), replay of gaps over the publisher's ROUTER, reconnect with backoff.

pub mod apply;
pub mod decode;
pub(crate) mod sequence;
pub mod subscriber;

pub use decode::{decode_batch, DecodeError, EngineBlockHash, EventBatch, KvEvent, Tier};
pub use subscriber::{Delivery, Source, SubscriberStats, Timing};

/// Where the engines publish KV events when no per-endpoint metadata says otherwise (vLLM's
/// `--kv-events-config` publisher: `tcp://<endpoint address>:<port>`).
#[derive(
    Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Subscribe to every ready endpoint's publisher.
    pub enabled: bool,
    /// The engines' KV-event PUB port.
    pub port: u16,
    /// The publisher's replay ROUTER port, if it has one.
    pub replay_port: Option<u16>,
    /// Topic prefix to subscribe to (`""`: everything).
    pub topic: String,
    /// The engines evict leaves first (vLLM, SGLang), so each holds a prefix-closed set of
    /// blocks and a prompt's cached prefix can be found by searching for where its holders change
    /// (a few dozen index lookups per distinct holder set) instead of reading every matched block.
    /// `false`: read every block (engines that may keep a block whose parent they evicted).
    pub prefix_closed: bool,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enabled: false,
            port: 5557,
            replay_port: None,
            topic: String::new(),
            prefix_closed: true,
        }
    }
}
