//! Session bindings: which worker rank a client's session (its session header) goes to.
//!
//! A binding is made or moved by every routed request that carries a session, refreshed by every
//! use, and forgotten `ttl` after its last use or when the table is full (least recently used
//! first, counted). Keys are 64-bit hashes of the header value ([`SessionKey::of`], the same on
//! every replica), so a binding costs the same whatever the header's length: about 90 bytes
//! (the key, the rank and its last use, the LRU's links and the hash table's slot).
//!
//! Invariants: a lookup never returns an expired binding; the table never holds more than its
//! capacity (rounded up to a multiple of its shard count); the shards' locks are held for one map
//! operation, never across a pick.

use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use lru::LruCache;
use parking_lot::Mutex;

use crate::types::WorkerRank;

/// A session, as the hash of its header value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(pub u64);

impl SessionKey {
    /// The key of session id `id` (xxh3 with a fixed seed: equal on every replica and build).
    pub fn of(id: &str) -> Self {
        SessionKey(xxhash_rust::xxh3::xxh3_64_with_seed(
            id.as_bytes(),
            0x5e55_1011,
        ))
    }

    /// The key of a session id as a client sent it (a header's raw bytes, a JSON string's).
    pub fn parse(raw: &[u8]) -> Result<Self, SessionIdError> {
        if raw.len() > MAX_SESSION_ID_BYTES {
            return Err(SessionIdError::TooLong(raw.len()));
        }
        let id = std::str::from_utf8(raw).map_err(|_| SessionIdError::NotUtf8)?;
        if id.is_empty() {
            return Err(SessionIdError::Empty);
        }
        Ok(SessionKey::of(id))
    }
}

/// Longest session id accepted (longer ones are ignored and counted by the caller).
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// Why a session id was ignored (the request is routed without a session).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionIdError {
    #[error("the session id is {0} bytes long; at most 256 are accepted")]
    TooLong(usize),
    #[error("the session id is not valid UTF-8")]
    NotUtf8,
    #[error("the session id is empty")]
    Empty,
}

impl SessionIdError {
    /// The metric label of the reason.
    pub fn as_str(&self) -> &'static str {
        match self {
            SessionIdError::TooLong(_) => "too_long",
            SessionIdError::NotUtf8 => "not_utf8",
            SessionIdError::Empty => "empty",
        }
    }
}

/// What routing a request with a session did to its binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionOutcome {
    /// It went to its bound endpoint.
    Hit,
    /// Its endpoint had left, was not eligible or was saturated: the binding moved to the pick.
    Moved,
    /// No binding yet: one was made.
    New,
}

impl SessionOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            SessionOutcome::Hit => "hit",
            SessionOutcome::Moved => "moved",
            SessionOutcome::New => "new",
        }
    }
}

/// `session_affinity` in the configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SessionAffinity {
    /// The request header carrying the session id (lower case; AIBrix's name by default). Empty:
    /// session affinity off.
    pub header: String,
    /// A binding unused this long is forgotten.
    pub ttl_seconds: u64,
    /// Bindings kept at most (least recently used dropped first, counted).
    pub max_sessions: usize,
}

impl Default for SessionAffinity {
    fn default() -> Self {
        SessionAffinity {
            header: "x-session-id".to_owned(),
            ttl_seconds: 600,
            max_sessions: 1_000_000,
        }
    }
}

impl SessionAffinity {
    pub fn enabled(&self) -> bool {
        !self.header.is_empty()
    }

    /// Every bad knob: `(name, message)`.
    pub fn validate(&self) -> Vec<(&'static str, String)> {
        let mut bad = Vec::new();
        let token = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c);
        if !self.header.chars().all(token) {
            bad.push((
                "header",
                format!(
                    "{:?} must be a lower-case HTTP header name (a-z, 0-9, '-', '_', '.'), or empty to turn session affinity off",
                    self.header
                ),
            ));
        }
        if self.ttl_seconds == 0 {
            bad.push(("ttl_seconds", "must be at least 1".to_owned()));
        }
        if self.max_sessions == 0 {
            bad.push(("max_sessions", "must be at least 1".to_owned()));
        }
        bad
    }

    /// The table these settings describe.
    pub fn table(&self) -> Sessions {
        Sessions::new(Duration::from_secs(self.ttl_seconds), self.max_sessions)
    }
}

#[derive(Debug, Clone, Copy)]
struct Binding {
    rank: WorkerRank,
    /// Last use ([`crate::types::clock_nanos`]).
    used: i64,
}

const SHARDS: usize = 16;

/// The bindings of one router: sharded LRU maps with a time to live.
#[derive(Debug)]
pub struct Sessions {
    shards: Box<[Mutex<LruCache<SessionKey, Binding>>]>,
    /// Bindings per shard and their time to live: changed live by [`Sessions::set_limits`].
    per_shard: AtomicUsize,
    ttl_nanos: AtomicI64,
    evicted: AtomicU64,
    expired: AtomicU64,
}

impl Default for Sessions {
    fn default() -> Self {
        SessionAffinity::default().table()
    }
}

impl Sessions {
    /// A table forgetting bindings `ttl` after their last use, holding about `max` of them.
    pub fn new(ttl: Duration, max: usize) -> Self {
        Sessions {
            // Unbounded maps with the bound kept here: a bounded one reserves its whole capacity
            // up front (tens of MB at a million sessions), even for a router no session reaches.
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::unbounded()))
                .collect(),
            per_shard: AtomicUsize::new(Self::shard_bound(max)),
            ttl_nanos: AtomicI64::new(Self::nanos(ttl)),
            evicted: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }

    fn shard_bound(max: usize) -> usize {
        max.div_ceil(SHARDS).max(1)
    }

    fn nanos(ttl: Duration) -> i64 {
        i64::try_from(ttl.as_nanos()).unwrap_or(i64::MAX)
    }

    /// New time to live and bound: bindings used longer than `ttl` ago count as expired from now
    /// on, and a shard over its new bound sheds its least recently used bindings at its next
    /// binding.
    pub fn set_limits(&self, ttl: Duration, max: usize) {
        self.ttl_nanos.store(Self::nanos(ttl), Ordering::Relaxed);
        self.per_shard
            .store(Self::shard_bound(max), Ordering::Relaxed);
    }

    fn shard(&self, key: SessionKey) -> &Mutex<LruCache<SessionKey, Binding>> {
        // The key is a hash already: its top bits pick the shard.
        &self.shards[(key.0 >> 60) as usize % SHARDS]
    }

    fn live(&self, b: &Binding, now: i64) -> bool {
        now.saturating_sub(b.used) < self.ttl_nanos.load(Ordering::Relaxed)
    }

    /// The rank `key` is bound to at `now` ([`crate::types::clock_nanos`]), if a binding is live.
    pub fn get(&self, key: SessionKey, now: i64) -> Option<WorkerRank> {
        let mut shard = self.shard(key).lock();
        let b = *shard.peek(&key)?;
        if self.live(&b, now) {
            Some(b.rank)
        } else {
            shard.pop(&key);
            self.expired.fetch_add(1, Ordering::Relaxed);
            None
        }
    }

    /// Binds `key` to `rank`, used at `now` (a later use than the binding's only moves it
    /// forward: a peer's older message never rewinds a fresher local use).
    pub fn bind(&self, key: SessionKey, rank: WorkerRank, now: i64) {
        let mut shard = self.shard(key).lock();
        if let Some(b) = shard.get_mut(&key) {
            if now >= b.used {
                *b = Binding { rank, used: now };
            }
            return;
        }
        // Over the bound (one binding, or more after `set_limits` shrank it): the least
        // recently used go.
        let bound = self.per_shard.load(Ordering::Relaxed);
        while shard.len() >= bound {
            let Some((_, old)) = shard.pop_lru() else {
                break;
            };
            if self.live(&old, now) {
                self.evicted.fetch_add(1, Ordering::Relaxed);
            } else {
                self.expired.fetch_add(1, Ordering::Relaxed);
            }
        }
        shard.push(key, Binding { rank, used: now });
    }

    /// Live bindings dropped because the table was full.
    pub fn evictions(&self) -> u64 {
        self.evicted.load(Ordering::Relaxed)
    }

    /// Bindings dropped because they were not used within the time to live.
    pub fn expirations(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// Bindings held (expired ones included until they are looked up or pushed out).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every live binding at `now`: its key, rank and the time since its last use (a peer's
    /// recovery).
    pub fn dump(&self, now: i64) -> Vec<(SessionKey, WorkerRank, Duration)> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let s = s.lock();
            out.extend(s.iter().filter(|(_, b)| self.live(b, now)).map(|(k, b)| {
                let age = u64::try_from(now.saturating_sub(b.used)).unwrap_or(0);
                (*k, b.rank, Duration::from_nanos(age))
            }));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i64 = 1_000_000_000;

    fn rank(worker: u64) -> WorkerRank {
        WorkerRank { worker, dp_rank: 0 }
    }

    #[test]
    fn bindings_expire_after_their_last_use_and_move_forward_only() {
        let t = Sessions::new(Duration::from_secs(10), 100);
        let k = SessionKey::of("conversation-1");
        assert_eq!(t.get(k, 0), None);
        t.bind(k, rank(1), 0);
        assert_eq!(t.get(k, 9 * SEC), Some(rank(1)));
        t.bind(k, rank(1), 9 * SEC);
        assert_eq!(t.get(k, 18 * SEC), Some(rank(1)), "refreshed by its use");
        // A peer's older binding does not rewind it.
        t.bind(k, rank(2), 5 * SEC);
        assert_eq!(t.get(k, 18 * SEC), Some(rank(1)));
        t.bind(k, rank(2), 18 * SEC);
        assert_eq!(t.get(k, 18 * SEC), Some(rank(2)), "moved");
        assert_eq!(t.get(k, 28 * SEC), None, "expired");
        assert_eq!(t.expirations(), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn a_full_table_drops_the_least_recently_used_and_counts_it() {
        let t = Sessions::new(Duration::from_secs(600), SHARDS);
        // Keys that land in one shard (capacity 1 each).
        let keys: Vec<SessionKey> = (0..3).map(SessionKey).collect();
        t.bind(keys[0], rank(1), 0);
        t.bind(keys[1], rank(2), 1);
        assert_eq!(t.get(keys[0], 2), None, "pushed out");
        assert_eq!(t.get(keys[1], 2), Some(rank(2)));
        assert_eq!(t.evictions(), 1);
        let full = Sessions::new(Duration::from_secs(600), 1000);
        for i in 0..5000u64 {
            full.bind(SessionKey::of(&i.to_string()), rank(i), 0);
        }
        assert!(full.len() <= 1008, "{}", full.len());
        assert_eq!(full.evictions() as usize, 5000 - full.len());
    }

    #[test]
    fn dump_lists_live_bindings_with_their_idle_time() {
        let t = Sessions::new(Duration::from_secs(10), 100);
        t.bind(SessionKey(1), rank(7), 0);
        t.bind(SessionKey(2 << 60), rank(8), 5 * SEC);
        let mut d = t.dump(12 * SEC);
        d.sort();
        assert_eq!(d, [(SessionKey(2 << 60), rank(8), Duration::from_secs(7))]);
    }

    #[test]
    fn keys_are_stable_and_settings_are_checked() {
        assert_eq!(SessionKey::parse(b"abc"), Ok(SessionKey::of("abc")));
        assert_eq!(
            SessionKey::parse(&[b'x'; 257]),
            Err(SessionIdError::TooLong(257))
        );
        assert!(SessionKey::parse(&[b'x'; 256]).is_ok());
        assert_eq!(SessionKey::parse(b"\xff\xfe"), Err(SessionIdError::NotUtf8));
        assert_eq!(SessionKey::parse(b""), Err(SessionIdError::Empty));
        assert_eq!(SessionKey::of("abc"), SessionKey::of("abc"));
        assert_ne!(SessionKey::of("abc"), SessionKey::of("abd"));
        assert!(SessionAffinity::default().validate().is_empty());
        let bad = SessionAffinity {
            header: "X Session".into(),
            ttl_seconds: 0,
            max_sessions: 0,
        };
        let names: Vec<_> = bad.validate().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["header", "ttl_seconds", "max_sessions"]);
        let off = SessionAffinity {
            header: String::new(),
            ..SessionAffinity::default()
        };
        assert!(!off.enabled() && off.validate().is_empty());
    }
}
