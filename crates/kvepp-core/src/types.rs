//! The core's shared leaf types: what several modules of the core (and the server) name, and
//! nothing else. It imports nothing from the crate but the hash newtypes (a leaf too), so every
//! module may import it without a
//! circle: worker ranks, cached-prefix overlaps, a prompt as blocks, the table hasher of the
//! indexes and the slot tracker, and the clock that scrape times are counted on.

use std::hash::{BuildHasher, Hasher};
use std::sync::LazyLock;
use std::time::Instant;

use xxhash_rust::xxh3::xxh3_64;

use crate::hash::{LocalBlockHash, SequenceHash};

/// Tokens per KV block when nothing says otherwise: vLLM's default `--block-size` on GPUs (and
/// the selection service's default for a worker registered without one).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// One data-parallel rank of a worker: the unit the index and the slot tracker count in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerRank {
    pub worker: u64,
    pub dp_rank: u32,
}

/// Cached prefix of a request on one rank, in blocks, cumulative over tiers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overlap {
    pub device: u64,
    /// Blocks cached on device or host (≥ `device`).
    pub host: u64,
    /// Blocks cached anywhere (≥ `host`).
    pub disk: u64,
}

/// Cached prefix of a request on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankOverlap {
    pub rank: WorkerRank,
    pub overlap: Overlap,
}

/// How the prefix of a request was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PrefixMode {
    TokenIds,
    Tokens,
    Approximate,
    None,
}

impl PrefixMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixMode::TokenIds => "token_ids",
            PrefixMode::Tokens => "tokens",
            PrefixMode::Approximate => "approximate",
            PrefixMode::None => "none",
        }
    }
}

/// A request's prompt as blocks.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptBlocks {
    pub mode: PrefixMode,
    pub locals: Vec<LocalBlockHash>,
    /// Shared, not copied, by the request's booking (the slot tracker's trie keeps it).
    pub hashes: std::sync::Arc<[SequenceHash]>,
    /// Prompt length in tokens (estimated in approximate mode).
    pub isl_tokens: u64,
}

/// Table hasher for keys that are already hashes: one folded multiply with a per-index key (a
/// random key, given by the caller, keeps crafted prompts from aiming at one bucket while costing
/// ~1 ns).
#[derive(Debug, Clone, Copy)]
pub struct KeyedBuild(u64);

impl KeyedBuild {
    pub fn with_key(key: u64) -> Self {
        KeyedBuild(key | 1)
    }
}

/// The table key of [`crate::index::PrefixIndex::new`]; servers pass a random one to [`crate::index::PrefixIndex::with_seed`].
pub const DEFAULT_TABLE_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

#[derive(Debug, Clone, Copy)]
pub struct KeyedHasher {
    key: u64,
    h: u64,
}

impl BuildHasher for KeyedBuild {
    type Hasher = KeyedHasher;
    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher { key: self.0, h: 0 }
    }
}

impl Hasher for KeyedHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.h = xxhash_rust::xxh3::xxh3_64_with_seed(bytes, self.key ^ self.h);
    }
    fn write_u64(&mut self, v: u64) {
        let m = u128::from(v ^ self.key ^ self.h) * 0x9E37_79B9_7F4A_7C15_u128;
        self.h = (m as u64) ^ ((m >> 64) as u64);
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn finish(&self) -> u64 {
        self.h
    }
}

/// The instant scrape times are counted from (any instant converts, before it or after).
static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);

/// `t` in nanoseconds from `ORIGIN` (negative before it; saturating at ±292 years).
pub fn clock_nanos(t: Instant) -> i64 {
    let origin = *ORIGIN;
    match t.checked_duration_since(origin) {
        Some(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        None => -i64::try_from(origin.duration_since(t).as_nanos()).unwrap_or(i64::MAX),
    }
}

/// The worker id of an endpoint (stable across discovery updates).
pub fn worker_id(addr: &str) -> u64 {
    xxh3_64(addr.as_bytes())
}
