//! One engine's KV block pool with prefix caching, as vLLM keeps it: `capacity` blocks of
//! `block_size` tokens shared by the running sequences and the cache of finished ones.
//!
//! A running sequence holds ([`Holding`]) every full block of its tokens, prompt and generated
//! alike, plus one private block for its unfinished tail. Full blocks are cached under their hash
//! chained to their parent and shared between sequences; a block becomes evictable only when no
//! running sequence holds it (pinning), and evictable blocks go least recently used first.
//!
//! Invariants:
//! - `pinned + private + evictable + free == capacity`, where pinned blocks are cached blocks
//!   some sequence holds and evictable ones are cached blocks nobody holds;
//! - a cached block's parent is cached: a holder of a block holds its ancestors, and a release
//!   marks ancestors more recently used than their descendants (tail first, as vLLM frees), so
//!   eviction always takes leaves;
//! - every change is reported as an event, in order: a subscriber replaying what
//!   [`KvPool::admit`], [`KvPool::grow`] and [`KvPool::clear`] return holds exactly
//!   [`KvPool::blocks`].
//!
//! Blocks are published when they are allocated (a prompt's at admission, a generated block when
//! its last token is scheduled), one scheduler step before vLLM would report them computed.

use std::collections::{BTreeMap, HashMap};

use xxhash_rust::xxh3::xxh3_64_with_seed;

use std::sync::Arc;

use kvepp_core::hash::{local_block_hashes, SequenceHash};

/// Seed of the engine's own block hash: it differs from the EPP's (as vLLM's sha256 does), so the
/// EPP must recompute its hashes from the events' token ids.
const ENGINE_HASH_SEED: u64 = 0x6b76_6570_7073_696d;

/// Token ids the simulated model generates are drawn from `0..VOCAB` (a Llama-3-sized vocabulary).
pub const VOCAB: u64 = 128_000;

/// The tokens a simulated engine generates after `prompt`: a deterministic function of the prompt,
/// so a client (or a workload generator) can carry them into the next turn token for token.
pub fn generated_tokens(prompt: &[u32], n: u32) -> Vec<u32> {
    let seed = generation_seed(prompt);
    (0..n).map(|i| generated_token(seed, i)).collect()
}

/// The seed of [`generated_token`] for a prompt.
pub fn generation_seed(prompt: &[u32]) -> u64 {
    let bytes: Vec<u8> = prompt.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, 0x6765_6e65_7261_7465)
}

/// The `i`-th generated token of the prompt with seed `seed`.
pub fn generated_token(seed: u64, i: u32) -> u32 {
    (xxh3_64_with_seed(&u64::from(i).to_le_bytes(), seed) % VOCAB) as u32
}

/// A change to the cache, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        token_ids: Vec<u32>,
        /// The LoRA adapter of the request that stored them (vLLM names it in the event).
        lora: Option<Arc<str>>,
    },
    Removed {
        hashes: Vec<u64>,
    },
    /// Everything is gone (the engine restarted); the publisher numbers anew from 0.
    Cleared,
}

/// Not enough free or evictable blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoom;

/// What admitting a prompt did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Admission {
    /// Prompt tokens served from the cache (whole blocks; the last prompt token is always
    /// computed, as in vLLM).
    pub cached_tokens: u64,
    pub holding: Holding,
    pub events: Vec<CacheEvent>,
}

/// A running sequence's blocks.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// Engine hashes of its full blocks, first to last.
    chain: Vec<u64>,
    /// The EPP's hash of the last full block, to chain the next one.
    last: Option<SequenceHash>,
    /// Its tokens after the last full block (held in one private block when not empty).
    tail: Vec<u32>,
    /// The LoRA adapter whose KV it is (seeds its blocks' hashes).
    lora: Option<Arc<str>>,
}

impl Holding {
    /// Tokens the sequence holds KV for.
    pub fn tokens(&self, block_size: usize) -> usize {
        self.chain.len() * block_size + self.tail.len()
    }
}

#[derive(Debug, Clone, Copy)]
struct Block {
    /// Running sequences holding it.
    refs: u32,
    /// Its place in the eviction order while `refs == 0`.
    tick: u64,
    /// The EPP's (Dynamo's) hash of the prefix ending here, for inspection.
    sequence: SequenceHash,
}

#[derive(Debug)]
pub struct KvPool {
    block_size: usize,
    capacity: usize,
    blocks: HashMap<u64, Block>,
    /// Evictable blocks by last use.
    lru: BTreeMap<u64, u64>,
    /// Cached blocks some sequence holds.
    pinned: usize,
    /// Sequences' unfinished tail blocks.
    private: usize,
    tick: u64,
}

impl KvPool {
    pub fn new(block_size: usize, capacity: usize) -> Self {
        KvPool {
            block_size: block_size.max(1),
            capacity,
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            pinned: 0,
            private: 0,
            tick: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Cached blocks (held or not).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Blocks held by running sequences (vLLM's KV cache usage).
    pub fn in_use(&self) -> usize {
        self.pinned + self.private
    }

    fn free(&self) -> usize {
        self.capacity
            .saturating_sub(self.blocks.len() + self.private)
    }

    /// The cached blocks as the EPP hashes them (sorted).
    pub fn blocks(&self) -> Vec<SequenceHash> {
        let mut v: Vec<SequenceHash> = self.blocks.values().map(|b| b.sequence).collect();
        v.sort_unstable_by_key(|h| h.0);
        v
    }

    fn local(&self, block: &[u32], lora: Option<&str>) -> kvepp_core::hash::LocalBlockHash {
        local_block_hashes(block, self.block_size, lora)
            .first()
            .copied()
            .unwrap_or(kvepp_core::hash::LocalBlockHash(0))
    }

    fn engine_hash(s: SequenceHash) -> u64 {
        xxh3_64_with_seed(&s.0.to_le_bytes(), ENGINE_HASH_SEED)
    }

    /// Holds a block: out of the eviction order while held.
    fn pin(&mut self, h: u64) {
        if let Some(b) = self.blocks.get_mut(&h) {
            if b.refs == 0 {
                self.lru.remove(&b.tick);
                self.pinned += 1;
            }
            b.refs += 1;
        }
    }

    /// Evicts least recently used blocks until `n` are free; the evicted hashes go to `out`.
    fn make_room(&mut self, n: usize, out: &mut Vec<u64>) -> Result<(), NoRoom> {
        while self.free() < n {
            let (_, victim) = self.lru.pop_first().ok_or(NoRoom)?;
            self.blocks.remove(&victim);
            out.push(victim);
        }
        Ok(())
    }

    /// Tokens of `tokens`' longest prefix of full blocks cached now (held or not), without
    /// touching the eviction order: what an admission right now would find (base model).
    pub fn cached_prefix_tokens(&self, tokens: &[u32]) -> usize {
        let mut parent = None;
        let mut n = 0;
        for block in tokens.chunks_exact(self.block_size) {
            let s = SequenceHash::chain(parent, self.local(block, None));
            if !self.blocks.contains_key(&Self::engine_hash(s)) {
                break;
            }
            parent = Some(s);
            n += 1;
        }
        n * self.block_size
    }

    /// Takes a prompt: counts its cached prefix, holds it, allocates the rest (evicting least
    /// recently used blocks) and reports the changes; [`NoRoom`] (and nothing changed) when the
    /// free and evictable blocks are too few.
    pub fn admit(&mut self, tokens: &[u32]) -> Result<Admission, NoRoom> {
        self.admit_lora(tokens, None)
    }

    /// [`Self::admit`] for a request of LoRA adapter `lora`: its blocks are the adapter's (their
    /// hashes seeded by its name, as vLLM's), never shared with the base model's or another's.
    pub fn admit_lora(
        &mut self,
        tokens: &[u32],
        lora: Option<Arc<str>>,
    ) -> Result<Admission, NoRoom> {
        let bs = self.block_size;
        let mut sequences = Vec::with_capacity(tokens.len() / bs);
        for block in tokens.chunks_exact(bs) {
            let local = self.local(block, lora.as_deref());
            sequences.push(SequenceHash::chain(sequences.last().copied(), local));
        }
        let engine: Vec<u64> = sequences.iter().map(|s| Self::engine_hash(*s)).collect();
        let present = engine
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        let tail = &tokens[engine.len() * bs..];
        let need = engine.len() - present + usize::from(!tail.is_empty());
        let evictable_present = engine[..present]
            .iter()
            .filter(|h| self.blocks.get(*h).is_some_and(|b| b.refs == 0))
            .count();
        if self.free() + self.lru.len() - evictable_present < need {
            return Err(NoRoom);
        }
        for h in &engine[..present] {
            self.pin(*h);
        }
        let mut evicted = Vec::new();
        self.make_room(need, &mut evicted)?;
        let mut events = Vec::new();
        if !evicted.is_empty() {
            events.push(CacheEvent::Removed { hashes: evicted });
        }
        for (h, s) in engine[present..].iter().zip(&sequences[present..]) {
            self.blocks.insert(
                *h,
                Block {
                    refs: 1,
                    tick: 0,
                    sequence: *s,
                },
            );
            self.pinned += 1;
        }
        if engine.len() > present {
            events.push(CacheEvent::Stored {
                parent: present.checked_sub(1).map(|i| engine[i]),
                hashes: engine[present..].to_vec(),
                token_ids: tokens[present * bs..engine.len() * bs].to_vec(),
                lora: lora.clone(),
            });
        }
        self.private += usize::from(!tail.is_empty());
        let reusable = tokens.len().saturating_sub(1) / bs;
        Ok(Admission {
            cached_tokens: (present.min(reusable) * bs) as u64,
            holding: Holding {
                last: sequences.last().copied(),
                chain: engine,
                tail: tail.to_vec(),
                lora,
            },
            events,
        })
    }

    /// Appends one token to a running sequence: a new tail block when the last one is full (after
    /// evicting one if none is free), and the tail cached once it fills (shared with an equal
    /// block already cached). [`NoRoom`] (and nothing changed) when a block is needed and none
    /// is free or evictable: the caller preempts a sequence.
    pub fn grow(&mut self, h: &mut Holding, token: u32) -> Result<Vec<CacheEvent>, NoRoom> {
        let mut events = Vec::new();
        if h.tail.is_empty() {
            let mut evicted = Vec::new();
            self.make_room(1, &mut evicted)?;
            if !evicted.is_empty() {
                events.push(CacheEvent::Removed { hashes: evicted });
            }
            self.private += 1;
        }
        h.tail.push(token);
        if h.tail.len() < self.block_size {
            return Ok(events);
        }
        let sequence = SequenceHash::chain(h.last, self.local(&h.tail, h.lora.as_deref()));
        let engine = Self::engine_hash(sequence);
        self.private -= 1;
        if let std::collections::hash_map::Entry::Vacant(slot) = self.blocks.entry(engine) {
            slot.insert(Block {
                refs: 1,
                tick: 0,
                sequence,
            });
            self.pinned += 1;
            events.push(CacheEvent::Stored {
                parent: h.chain.last().copied(),
                hashes: vec![engine],
                token_ids: std::mem::take(&mut h.tail),
                lora: h.lora.clone(),
            });
        } else {
            self.pin(engine);
        }
        h.tail.clear();
        h.chain.push(engine);
        h.last = Some(sequence);
        Ok(events)
    }

    /// Lets go of a sequence's blocks (finished, aborted or preempted): its cached blocks stay
    /// cached and become evictable once nobody holds them, tail first.
    pub fn release(&mut self, h: Holding) {
        if !h.tail.is_empty() {
            self.private -= 1;
        }
        for e in h.chain.iter().rev() {
            if let Some(b) = self.blocks.get_mut(e) {
                b.refs = b.refs.saturating_sub(1);
                if b.refs == 0 {
                    self.tick += 1;
                    b.tick = self.tick;
                    self.lru.insert(self.tick, *e);
                    self.pinned -= 1;
                }
            }
        }
    }

    /// Empties the pool (an engine restart: every holding is void).
    pub fn clear(&mut self) -> Vec<CacheEvent> {
        *self = KvPool::new(self.block_size, self.capacity);
        vec![CacheEvent::Cleared]
    }

    /// Checks the accounting invariant (tests).
    pub fn check(&self) -> Result<(), String> {
        let pinned = self.blocks.values().filter(|b| b.refs > 0).count();
        let evictable = self.blocks.len() - pinned;
        if pinned != self.pinned || evictable != self.lru.len() {
            return Err(format!(
                "pinned {pinned} (counted {}), evictable {evictable} (in order {})",
                self.pinned,
                self.lru.len()
            ));
        }
        if self.blocks.len() + self.private > self.capacity {
            return Err(format!(
                "{} cached + {} private blocks over a capacity of {}",
                self.blocks.len(),
                self.private,
                self.capacity
            ));
        }
        Ok(())
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

    fn stored(events: &[CacheEvent]) -> usize {
        events
            .iter()
            .map(|e| match e {
                CacheEvent::Stored { hashes, .. } => hashes.len(),
                _ => 0,
            })
            .sum()
    }

    fn removed(events: &[CacheEvent]) -> usize {
        events
            .iter()
            .map(|e| match e {
                CacheEvent::Removed { hashes } => hashes.len(),
                _ => 0,
            })
            .sum()
    }

    /// Admits and releases at once (a request that finished).
    fn serve(c: &mut KvPool, p: &[u32]) -> (u64, Vec<CacheEvent>) {
        let a = c.admit(p).unwrap();
        c.release(a.holding);
        (a.cached_tokens, a.events)
    }

    #[test]
    fn longest_prefix_is_reused_and_new_blocks_stored() {
        let mut c = KvPool::new(4, 100);
        let p = prompt(1, 3, 4);
        let (hit, ev) = serve(&mut c, &p);
        assert_eq!((hit, stored(&ev), removed(&ev)), (0, 3, 0));
        // Same prompt again: all but the last block (its last token is recomputed).
        let (hit, ev) = serve(&mut c, &p);
        assert_eq!((hit, stored(&ev)), (8, 0));
        // Extended by one token: all three blocks are reused.
        let mut q = p.clone();
        q.push(7);
        assert_eq!(serve(&mut c, &q).0, 12);
        // Extended by two blocks: one Stored event chained to the last cached block.
        let mut r = p.clone();
        r.extend(prompt(2, 2, 4));
        let (hit, ev) = serve(&mut c, &r);
        assert_eq!(hit, 12);
        match &ev[..] {
            [CacheEvent::Stored {
                parent: Some(_),
                hashes,
                token_ids,
                lora: None,
            }] => {
                assert_eq!(hashes.len(), 2);
                assert_eq!(token_ids[..], r[12..20]);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(c.len(), 5);
        c.check().unwrap();
    }

    #[test]
    fn the_cached_prefix_is_read_without_touching_the_eviction_order() {
        let mut c = KvPool::new(4, 4);
        let (p, q) = (prompt(1, 2, 4), prompt(2, 2, 4));
        assert_eq!(c.cached_prefix_tokens(&p), 0);
        serve(&mut c, &p);
        serve(&mut c, &q);
        let mut longer = p.clone();
        longer.extend(prompt(3, 1, 4));
        assert_eq!(c.cached_prefix_tokens(&longer), 8);
        assert_eq!(c.cached_prefix_tokens(&p[..6]), 4, "only full blocks count");
        // Reading p did not make it recent: a new prompt evicts p's blocks first, not q's.
        serve(&mut c, &prompt(4, 2, 4));
        assert_eq!(c.cached_prefix_tokens(&p), 0);
        assert_eq!(c.cached_prefix_tokens(&q), 8);
    }

    #[test]
    fn eviction_is_lru_and_takes_leaves_first() {
        let mut c = KvPool::new(2, 6);
        let a = prompt(1, 3, 2);
        let b = prompt(2, 3, 2);
        serve(&mut c, &a);
        serve(&mut c, &b);
        assert_eq!(c.len(), 6);
        // `a` used again: `b` is now the least recently used.
        serve(&mut c, &a);
        let (_, ev) = serve(&mut c, &prompt(3, 2, 2));
        assert_eq!(removed(&ev), 2);
        // b's tail went first: its first block is still there, a is whole.
        assert_eq!(serve(&mut c, &a).0, 4);
        let mut b_then = b[..2].to_vec();
        b_then.push(99);
        assert_eq!(serve(&mut c, &b_then).0, 2);
        assert!(c.len() <= 6);
        c.check().unwrap();
    }

    #[test]
    fn held_blocks_are_not_evicted_and_room_runs_out() {
        let mut c = KvPool::new(2, 6);
        let a = c.admit(&prompt(1, 3, 2)).unwrap();
        assert_eq!(c.in_use(), 3);
        // 3 free blocks: a 4-block prompt must wait, a 3-block one fits.
        assert_eq!(c.admit(&prompt(2, 4, 2)), Err(NoRoom));
        let b = c.admit(&prompt(2, 3, 2)).unwrap();
        assert_eq!(removed(&b.events), 0);
        assert_eq!(c.in_use(), 6);
        // Nothing is evictable while both run.
        assert_eq!(c.admit(&prompt(3, 1, 2)), Err(NoRoom));
        let mut bh = b.holding;
        assert_eq!(c.grow(&mut bh, 5), Err(NoRoom));
        c.release(a.holding);
        // `a` is evictable now: growing `b` takes a's last block first.
        let ev = c.grow(&mut bh, 5).unwrap();
        assert_eq!(removed(&ev), 1);
        assert_eq!(c.admit(&prompt(1, 2, 2)).unwrap().cached_tokens, 2);
        c.check().unwrap();
    }

    #[test]
    fn generated_blocks_are_cached_and_a_next_turn_reuses_them() {
        let mut c = KvPool::new(4, 100);
        let p: Vec<u32> = prompt(1, 2, 4).into_iter().chain([9, 9]).collect();
        let mut a = c.admit(&p).unwrap();
        assert_eq!(c.in_use(), 3);
        let out = generated_tokens(&p, 7);
        let mut events = Vec::new();
        for t in &out {
            events.extend(c.grow(&mut a.holding, *t).unwrap());
        }
        // 10 + 7 tokens: blocks 3 and 4 filled (and published), one token in a new tail block.
        assert_eq!(stored(&events), 2);
        assert_eq!((c.len(), c.in_use()), (4, 5));
        assert_eq!(a.holding.tokens(4), 17);
        c.release(a.holding);
        assert_eq!(c.in_use(), 0);
        // The next turn: the previous prompt, the answer, a new question.
        let mut next = p.clone();
        next.extend(&out);
        next.extend([1, 2, 3, 4, 5]);
        assert_eq!(serve(&mut c, &next).0, 16);
        // The same answer generated again shares the cached blocks (nothing new published).
        let mut b = c.admit(&p).unwrap();
        let events: Vec<CacheEvent> = out
            .iter()
            .flat_map(|t| c.grow(&mut b.holding, *t).unwrap())
            .collect();
        assert_eq!(stored(&events), 0, "{events:?}");
        c.release(b.holding);
        c.check().unwrap();
        assert_eq!(generated_tokens(&p, 7), out, "deterministic");
        assert_ne!(generated_tokens(&next, 7), out);
    }

    /// Replaying the events reproduces the cache (the property the EPP relies on), with sequences
    /// held, grown, released and the pool cleared.
    #[test]
    fn events_replayed_give_the_cache() {
        let mut c = KvPool::new(4, 40);
        let mut mirror = std::collections::HashSet::new();
        let mut rng = fastrand::Rng::with_seed(7);
        let mut running: Vec<Holding> = Vec::new();
        let apply = |events: Vec<CacheEvent>, mirror: &mut std::collections::HashSet<u64>| {
            for e in events {
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
                    CacheEvent::Cleared => mirror.clear(),
                }
            }
        };
        for step in 0..2000 {
            match rng.u32(0..10) {
                0..=2 => {
                    let head = rng.u32(0..6);
                    let mut p = prompt(head, rng.usize(1..4), 4);
                    p.extend(prompt(100 + rng.u32(0..30), rng.usize(0..3), 4));
                    p.extend((0..rng.usize(0..4)).map(|_| rng.u32(..)));
                    if let Ok(a) = c.admit(&p) {
                        apply(a.events, &mut mirror);
                        running.push(a.holding);
                    }
                }
                3..=6 if !running.is_empty() => {
                    let i = rng.usize(..running.len());
                    match c.grow(&mut running[i], rng.u32(0..3)) {
                        Ok(ev) => apply(ev, &mut mirror),
                        // Preempt the latest.
                        Err(NoRoom) => c.release(running.pop().unwrap()),
                    }
                }
                7..=8 if !running.is_empty() => {
                    let h = running.swap_remove(rng.usize(..running.len()));
                    c.release(h);
                }
                9 if step % 500 == 0 => {
                    running.clear();
                    apply(c.clear(), &mut mirror);
                }
                _ => {}
            }
            c.check().unwrap();
        }
        let mut cached: Vec<u64> = c.blocks.keys().copied().collect();
        let mut seen: Vec<u64> = mirror.into_iter().collect();
        cached.sort_unstable();
        seen.sort_unstable();
        assert_eq!(cached, seen);
    }
}
