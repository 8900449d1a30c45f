//! A bounded cache keyed by 128-bit content hashes, kept in two generations: entries go into the
//! current one; a hit in the previous one moves the entry back into the current one; when the
//! current one holds half the capacity (by the weight each entry declares) the previous one is
//! dropped and the current one becomes the previous. So what was used within the last half
//! capacity survives, without per-entry recency bookkeeping.
//!
//! [`ContentCache`] shares one between threads, keyed by a 128-bit hash of each value's source
//! bytes (the segment and message caches of a model's tokenizer, the chunk cache of token-id
//! prompts).
//!
//! Invariants: the weights held never exceed the capacity (an entry heavier than half of it is
//! never kept); hits and misses are counted by [`Generations::get`]; a value is made outside the
//! lock, so a miss never holds up other lookups.

use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;

use xxhash_rust::xxh3::xxh3_128;

/// Hit and miss counts, for tests, benchmarks and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
}

#[derive(Debug)]
struct Generations<V> {
    current: HashMap<u128, (V, usize)>,
    /// Weight held by `current`.
    current_weight: usize,
    previous: HashMap<u128, (V, usize)>,
    /// Weight per generation.
    half: usize,
    stats: CacheStats,
}

impl<V: Clone> Generations<V> {
    /// A cache holding at most `capacity` weight.
    pub fn new(capacity: usize) -> Self {
        Generations {
            current: HashMap::new(),
            current_weight: 0,
            previous: HashMap::new(),
            half: (capacity / 2).max(1),
            stats: CacheStats::default(),
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The value under `key`, counted as a hit or a miss.
    pub fn get(&mut self, key: u128) -> Option<V> {
        let found = self.find(key);
        match found {
            Some(_) => self.stats.hits += 1,
            None => self.stats.misses += 1,
        }
        found
    }

    /// Keeps the entry under `key` in the current generation, as a hit would (uncounted): moved
    /// there from the previous one, or `value` (of `weight`) put back when it was dropped.
    pub fn keep(&mut self, key: u128, value: V, weight: usize) {
        if self.find(key).is_none() {
            self.insert(key, value, weight);
        }
    }

    /// The value under `key`, moved into the current generation if it was in the previous one
    /// (uncounted).
    fn find(&mut self, key: u128) -> Option<V> {
        match self.current.get(&key) {
            Some((v, _)) => Some(v.clone()),
            None => self.previous.remove(&key).map(|(v, w)| {
                self.admit(key, v.clone(), w);
                v
            }),
        }
    }

    /// Keeps `value` (of `weight`) under `key`, unless it weighs more than a generation.
    pub fn insert(&mut self, key: u128, value: V, weight: usize) {
        if weight <= self.half {
            self.admit(key, value, weight);
        }
    }

    fn admit(&mut self, key: u128, value: V, weight: usize) {
        // One copy of a key at most, in either generation.
        if let Some((_, old)) = self.current.remove(&key) {
            self.current_weight -= old;
        }
        self.previous.remove(&key);
        if self.current_weight + weight > self.half {
            self.previous = std::mem::take(&mut self.current);
            self.current_weight = 0;
        }
        self.current_weight += weight;
        self.current.insert(key, (value, weight));
    }

    /// Total weight held (both generations).
    fn weight(&self) -> usize {
        self.current
            .values()
            .chain(self.previous.values())
            .map(|(_, w)| w)
            .sum()
    }
}

/// Values made from content bytes, remembered by the bytes' xxh3-128 (same bytes, same value)
/// in a bounded [`Generations`] behind a lock.
#[derive(Debug)]
pub struct ContentCache<V> {
    inner: Mutex<Generations<V>>,
    /// What an entry weighs beyond its value's own weight (key, table slot, allocation).
    overhead: usize,
}

impl<V: Clone> ContentCache<V> {
    /// A cache holding at most `capacity` weight, each entry weighing `overhead` more than its
    /// value.
    pub fn new(capacity: usize, overhead: usize) -> Self {
        ContentCache {
            inner: Mutex::new(Generations::new(capacity)),
            overhead,
        }
    }

    pub fn stats(&self) -> CacheStats {
        self.lock().stats()
    }

    /// The key `content` is remembered under.
    pub fn key(content: &[u8]) -> u128 {
        xxh3_128(content)
    }

    /// The value made from the content whose [`Self::key`] is `key`: remembered, or made by
    /// `make` (the value and its weight) without the lock held, then remembered.
    pub fn get_or_make_keyed<E>(
        &self,
        key: u128,
        make: impl FnOnce() -> Result<(V, usize), E>,
    ) -> Result<V, E> {
        if let Some(v) = self.lock().get(key) {
            return Ok(v);
        }
        let (v, weight) = make()?;
        self.lock().insert(key, v.clone(), weight + self.overhead);
        Ok(v)
    }

    /// The value remembered for `content`, if any (counted as a hit or a miss).
    pub fn get(&self, content: &[u8]) -> Option<V> {
        self.lock().get(Self::key(content))
    }

    /// Remembers `value` (weighing `weight`) as made from `content`.
    pub fn insert(&self, content: &[u8], value: V, weight: usize) {
        self.lock()
            .insert(Self::key(content), value, weight + self.overhead);
    }

    /// Keeps each `(key, value, weight)` as a hit would (uncounted, under one lock): values a
    /// caller reuses without looking them up stay as recent as if it had.
    pub fn keep_all(&self, entries: impl IntoIterator<Item = (u128, V, usize)>) {
        let mut g = self.lock();
        for (key, value, weight) in entries {
            g.keep(key, value, weight + self.overhead);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Generations<V>> {
        self.inner.lock()
    }

    /// Total weight held.
    pub fn weight(&self) -> usize {
        self.lock().weight()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_and_recent_entries_survive() {
        let mut g = Generations::new(100);
        for k in 0..1_000u128 {
            g.insert(k, k, 7);
            assert!(g.weight() <= 100, "{} after {k}", g.weight());
            // The entry just added and the one before it are still there.
            assert_eq!(g.get(k), Some(k));
            if k > 0 {
                assert_eq!(g.get(k - 1), Some(k - 1));
            }
        }
        assert_eq!(g.get(0), None, "the oldest is gone");
        let s = g.stats();
        assert_eq!((s.hits, s.misses), (1_999, 1));
        g.insert(5_000, 5_000, 51);
        assert_eq!(g.get(5_000), None, "heavier than a generation: never kept");
    }

    #[test]
    fn kept_entries_stay_recent_and_dropped_ones_come_back() {
        let c = ContentCache::new(40, 0);
        c.insert(b"a", 1u32, 10);
        c.insert(b"b", 2, 10);
        // A third entry fills the generation: `a` and `b` move to the previous one.
        c.insert(b"c", 3, 10);
        c.keep_all([(ContentCache::<u32>::key(b"a"), 1, 10)]);
        // Filling the generation again drops the previous one, but for `a`, kept in between.
        c.insert(b"d", 4, 10);
        c.insert(b"e", 5, 10);
        assert_eq!(c.get(b"a"), Some(1), "kept");
        assert_eq!(c.get(b"b"), None, "not kept: dropped");
        c.keep_all([(ContentCache::<u32>::key(b"b"), 2, 10)]);
        assert_eq!(c.get(b"b"), Some(2), "put back");
        assert!(c.weight() <= 40);
    }

    #[test]
    fn a_reinserted_key_is_weighed_once() {
        let mut g = Generations::new(100);
        for _ in 0..10 {
            g.insert(1, 'a', 30);
        }
        assert_eq!(g.weight(), 30);
        g.insert(2, 'b', 20);
        assert_eq!((g.get(1), g.get(2)), (Some('a'), Some('b')));
    }
}
