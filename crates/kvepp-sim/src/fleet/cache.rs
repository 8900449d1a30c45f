//! One engine's prefix cache: blocks of `block_size` tokens chained to their parent, evicted least
//! recently used first, with a capacity in blocks. A prompt reuses its longest cached prefix.
//!
//! Invariants:
//! - a cached block's parent is cached: every use of a block also uses its ancestors, and they
//!   are marked more recently used than it (as vLLM frees a request's blocks tail first), so
//!   eviction always takes leaves;
//! - the blocks of the prompt being admitted are never evicted by its own admission (at most
//!   `capacity` of them are stored);
//! - every change is reported as an event, in order: what [`PrefixCache::admit`] returns is what
//!   the engine publishes, so a subscriber replaying the events holds exactly [`PrefixCache::blocks`].

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use kvepp_core::hash::{local_block_hashes, sequence_hashes, SequenceHash};

/// Seed of the engine's own block hash: it differs from the EPP's (as vLLM's sha256 does), so the
/// EPP must recompute its hashes from the events' token ids.
const ENGINE_HASH_SEED: u64 = 0x6b76_6570_7073_696d;

/// A change to the cache, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        token_ids: Vec<u32>,
    },
    Removed {
        hashes: Vec<u64>,
    },
}

/// What admitting a prompt did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// Prompt tokens served from the cache (whole blocks; the last prompt token is always
    /// computed, as in vLLM).
    pub cached_tokens: u64,
    pub events: Vec<CacheEvent>,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    tick: u64,
    /// The EPP's (Dynamo's) hash of the prefix ending here, for inspection.
    sequence: SequenceHash,
}

#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity: usize,
    blocks: HashMap<u64, Block>,
    lru: BTreeMap<u64, u64>,
    tick: u64,
}

impl PrefixCache {
    pub fn new(block_size: usize, capacity: usize) -> Self {
        PrefixCache {
            block_size: block_size.max(1),
            capacity,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The cached blocks as the EPP hashes them (sorted).
    pub fn blocks(&self) -> Vec<SequenceHash> {
        let mut v: Vec<SequenceHash> = self.blocks.values().map(|b| b.sequence).collect();
        v.sort_unstable_by_key(|h| h.0);
        v
    }

    /// Takes a prompt: counts its cached prefix, marks it used, stores its uncached full blocks
    /// (evicting least recently used ones to make room) and reports the changes.
    pub fn admit(&mut self, tokens: &[u32]) -> Admission {
        let bs = self.block_size;
        let sequences = sequence_hashes(&local_block_hashes(tokens, bs, None));
        let engine: Vec<u64> = sequences
            .iter()
            .map(|s| xxh3_64_with_seed(&s.0.to_le_bytes(), ENGINE_HASH_SEED))
            .collect();
        let keep = engine.len().min(self.capacity);
        let present = engine[..keep]
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        let reusable = tokens.len().saturating_sub(1) / bs;
        let mut out = Admission {
            cached_tokens: (present.min(reusable) * bs) as u64,
            events: Vec::new(),
        };
        // The prefix in use leaves the eviction order while room is made.
        for h in &engine[..present] {
            if let Some(b) = self.blocks.get(h) {
                self.lru.remove(&b.tick);
            }
        }
        let mut evicted = Vec::new();
        while self.blocks.len() + (keep - present) > self.capacity {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&victim);
            evicted.push(victim);
        }
        if !evicted.is_empty() {
            out.events.push(CacheEvent::Removed { hashes: evicted });
        }
        for (h, s) in engine[present..keep].iter().zip(&sequences[present..keep]) {
            self.blocks.insert(
                *h,
                Block {
                    tick: 0,
                    sequence: *s,
                },
            );
        }
        // Tail first, so ancestors are always more recently used than their descendants.
        for h in engine[..keep].iter().rev() {
            self.tick += 1;
            if let Some(b) = self.blocks.get_mut(h) {
                self.lru.remove(&b.tick);
                b.tick = self.tick;
                self.lru.insert(self.tick, *h);
            }
        }
        if keep > present {
            out.events.push(CacheEvent::Stored {
                parent: present.checked_sub(1).map(|i| engine[i]),
                hashes: engine[present..keep].to_vec(),
                token_ids: tokens[present * bs..keep * bs].to_vec(),
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(seed: u32, blocks: usize, bs: usize) -> Vec<u32> {
        (0..(blocks * bs) as u32)
            .map(|i| seed * 1_000_000 + i)
            .collect()
    }

    fn stored(a: &Admission) -> usize {
        a.events
            .iter()
            .map(|e| match e {
                CacheEvent::Stored { hashes, .. } => hashes.len(),
                CacheEvent::Removed { .. } => 0,
            })
            .sum()
    }

    fn removed(a: &Admission) -> usize {
        a.events
            .iter()
            .map(|e| match e {
                CacheEvent::Removed { hashes } => hashes.len(),
                CacheEvent::Stored { .. } => 0,
            })
            .sum()
    }

    #[test]
    fn longest_prefix_is_reused_and_new_blocks_stored() {
        let mut c = PrefixCache::new(4, 100);
        let p = prompt(1, 3, 4);
        let a = c.admit(&p);
        assert_eq!((a.cached_tokens, stored(&a), removed(&a)), (0, 3, 0));
        // Same prompt again: all but the last block (its last token is recomputed).
        let a = c.admit(&p);
        assert_eq!((a.cached_tokens, stored(&a)), (8, 0));
        // Extended by one token: all three blocks are reused.
        let mut q = p.clone();
        q.push(7);
        assert_eq!(c.admit(&q).cached_tokens, 12);
        // Extended by two blocks: one Stored event chained to the last cached block.
        let mut r = p.clone();
        r.extend(prompt(2, 2, 4));
        let a = c.admit(&r);
        assert_eq!(a.cached_tokens, 12);
        match &a.events[..] {
            [CacheEvent::Stored {
                parent: Some(_),
                hashes,
                token_ids,
            }] => {
                assert_eq!(hashes.len(), 2);
                assert_eq!(token_ids[..], r[12..20]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.len(), 5);
    }

    #[test]
    fn eviction_is_lru_and_takes_leaves_first() {
        let mut c = PrefixCache::new(2, 6);
        let a = prompt(1, 3, 2);
        let b = prompt(2, 3, 2);
        c.admit(&a);
        c.admit(&b);
        assert_eq!(c.len(), 6);
        // `a` used again: `b` is now the least recently used.
        c.admit(&a);
        let x = c.admit(&prompt(3, 2, 2));
        assert_eq!(removed(&x), 2);
        // b's tail went first: its first block is still there, a is whole.
        assert_eq!(c.admit(&a).cached_tokens, 4);
        let mut b_then = b[..2].to_vec();
        b_then.push(99);
        assert_eq!(c.admit(&b_then).cached_tokens, 2);
        assert!(c.len() <= 6);
    }

    #[test]
    fn a_prompt_longer_than_the_cache_keeps_its_head() {
        let mut c = PrefixCache::new(2, 3);
        let p = prompt(1, 5, 2);
        let a = c.admit(&p);
        assert_eq!((stored(&a), c.len()), (3, 3));
        let a = c.admit(&p);
        assert_eq!((a.cached_tokens, stored(&a), removed(&a)), (6, 0, 0));
    }

    /// Replaying the events reproduces the cache (the property the EPP relies on).
    #[test]
    fn events_replayed_give_the_cache() {
        let mut c = PrefixCache::new(4, 40);
        let mut mirror = std::collections::HashSet::new();
        let mut rng = fastrand::Rng::with_seed(7);
        for _ in 0..500 {
            let head = rng.u32(0..6);
            let mut p = prompt(head, rng.usize(1..6), 4);
            p.extend(prompt(100 + rng.u32(0..30), rng.usize(0..5), 4));
            for e in c.admit(&p).events {
                match e {
                    CacheEvent::Stored { parent, hashes, .. } => {
                        assert!(parent.is_none_or(|h| mirror.contains(&h)), "orphan");
                        mirror.extend(hashes);
                    }
                    CacheEvent::Removed { hashes } => {
                        for h in hashes {
                            assert!(mirror.remove(&h), "removed an unknown block");
                        }
                    }
                }
            }
            assert!(c.len() <= 40);
        }
        let mut cached: Vec<u64> = c.blocks.keys().copied().collect();
        let mut seen: Vec<u64> = mirror.into_iter().collect();
        cached.sort_unstable();
        seen.sort_unstable();
        assert_eq!(cached, seen);
    }
}
