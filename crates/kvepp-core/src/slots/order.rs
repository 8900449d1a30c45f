//! Ranks ordered by load, for picks that do not read every rank: each registered rank's *load
//! key* (what Dynamo's cost charges for the load it already has, under the weights the order
//! was keyed with), kept beside the slot tracker's published views and updated with them.
//!
//! The key of a rank with `P` prefill tokens, `D` decode blocks and `A` active requests is
//! `s · P / block_size + D + w · A` (`s`: prefill load scale, `w`: decode active request weight).
//! A rank that caches nothing of a prompt and has none of it active costs exactly its key plus
//! the prompt's own share (the same for every such rank), so the cheapest of those ranks are
//! those of least key: a pick finds them by [`LoadOrder::visit`] instead of reading every rank.
//!
//! Layout: keys sit in arrays of `RANKS_PER_CHUNK` per chunk of dense ids (the slot tracker's
//! chunks, made on first use with their group words); each group of 16 dense ids has one word
//! holding a lower bound of its keys (the top 32 bits of the least key's `f64`, which order like
//! the keys themselves for keys ≥ 0) and a version, and each chunk one word of the same shape
//! bounding its groups' bounds. A visit pops what is left least first from a heap: a chunk's
//! word (it then reads the chunk's group words), a group's (it then reads the group's keys) or
//! a rank's key (it visits the rank), so it meets ranks in key order and reads only groups
//! whose bound is within its limit when their turn comes.
//!
//! Invariants:
//! - a group's bound never exceeds the key of any rank in it, and a chunk's never exceeds the
//!   bound of any group in it: a writer whose key fell stores it, then lowers the group's bound
//!   and the chunk's to it if needed, moving both versions on even where a bound was already
//!   lower (a key that rose leaves the words alone: the bounds still hold); a reader that read
//!   a group's keys (a chunk's group words) raises its bound to the least it found only if no
//!   writer moved the version on since it read the word, so a raise never hides a key stored
//!   meanwhile;
//! - a free dense id's key is +∞ (never visited);
//! - keys are computed with the parameters [`LoadOrder::params`] names; while they change
//!   ([`LoadOrder::rekey`]), [`LoadOrder::keyed_with`] answers false and picks read every rank.
//!
//! Keys are read and written without a lock (the writer of a rank's key holds that rank's cell
//! lock, so writers of one key are one at a time); what a visit reads is not one snapshot, like
//! everything a pick reads of the tracker.

use parking_lot::Mutex;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::RankView;

/// What keys are computed with: the prefill load scale, tokens per block and the weight of an
/// active request (Dynamo's cost's load terms).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyParams {
    pub prefill_load_scale: f64,
    pub block_size: u32,
    pub per_request: f64,
}

impl KeyParams {
    /// The key of a rank whose view is `v` (+∞ for a free id; never NaN or negative: such
    /// parameters key everything 0, which only makes a pick visit more).
    fn key(&self, v: &RankView) -> f64 {
        if v.dp_rank_plus_one == 0 {
            return f64::INFINITY;
        }
        let k = self.prefill_load_scale
            * (v.prefill_tokens as f64 * (1.0 / f64::from(self.block_size.max(1))))
            + v.decode_blocks as f64
            + self.per_request * f64::from(v.active_requests);
        if k >= 0.0 {
            k
        } else {
            0.0
        }
    }
}

/// The bound word of a key: the top half of its bits (monotone in the key for keys ≥ 0).
fn bound_of(key: f64) -> u32 {
    (key.to_bits() >> 32) as u32
}

/// The least key a bound word allows.
fn key_of_bound(bound: u32) -> f64 {
    f64::from_bits(u64::from(bound) << 32)
}

fn word(bound: u32, version: u32) -> u64 {
    (u64::from(bound) << 32) | u64::from(version)
}

/// Ranks a group's bound word covers: bookings on ranks of different groups never write the
/// same group word.
const GROUP: usize = 16;

/// What a visit pops in key order: a rank, a group of ranks or a chunk of groups (the tag's top
/// two bits; the rest is its number).
const RANK: u32 = 0;
const GROUP_TAG: u32 = 1 << 30;
const CHUNK_TAG: u32 = 2 << 30;
const NUMBER: u32 = (1 << 30) - 1;

/// Reusable space of [`super::SharedSlots::visit_by_load`] (one per picking thread): its heap of what is still to
/// read, least key or bound first.
#[derive(Debug, Default)]
pub struct VisitScratch(Vec<Reverse<(u64, u32)>>);

/// One chunk of dense ids: their keys and, per group of them, a bound word.
#[derive(Debug)]
struct Chunk {
    keys: Box<[AtomicU64]>,
    groups: Box<[AtomicU64]>,
}

/// Reads load keys one id at a time, as `LoadOrder::key` does, keeping the last chunk found:
/// ids read in order (a level's holders, in slot order) mostly fall in the chunk of the one
/// before.
#[derive(Debug)]
pub struct KeyReader<'a> {
    order: &'a LoadOrder,
    chunk: usize,
    keys: &'a [AtomicU64],
}

impl KeyReader<'_> {
    /// The key of dense id `id` (+∞ if none).
    #[inline]
    pub fn key(&mut self, id: u32) -> f64 {
        let (c, at) = self.order.split(id);
        if c != self.chunk {
            self.chunk = c;
            self.keys = self
                .order
                .chunks
                .get(c)
                .and_then(OnceLock::get)
                .map_or(&[], |k| &k.keys[..]);
        }
        self.keys
            .get(at)
            .map_or(f64::INFINITY, |k| f64::from_bits(k.load(Ordering::Acquire)))
    }
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct LoadOrder {
    /// Ranks per chunk: a power of two, `1 << shift`.
    per_chunk: usize,
    shift: u32,
    /// Ranks per group word (divides `per_chunk`).
    group: usize,
    chunks: Box<[OnceLock<Chunk>]>,
    /// Per chunk: a bound of its groups' bounds (high half) and a version (low half).
    tops: Box<[AtomicU64]>,
    /// The parameters keys are computed with (f64 bits, block size, f64 bits) and whether a
    /// rekey is under way (odd `state`).
    params: [AtomicU64; 3],
    state: AtomicU64,
    rekeying: Mutex<()>,
}

/// Lowers the bound in word `w` to `b` (if above) and moves its version on either way: a
/// reader that read the word before cannot raise it after.
fn lower(w: &AtomicU64, b: u32) {
    let mut old = w.load(Ordering::Relaxed);
    loop {
        let new = word(((old >> 32) as u32).min(b), (old as u32).wrapping_add(1));
        match w.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => break,
            Err(x) => old = x,
        }
    }
}

/// Raises the bound in word `w` to `b`, the least of what it covers as read after `seen` was
/// read from it, unless a writer lowered something since (the version moved on) or it is not
/// higher.
fn raise(w: &AtomicU64, seen: u64, b: u32) {
    if b > (seen >> 32) as u32 {
        let _ = w.compare_exchange(
            seen,
            word(b, seen as u32),
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

impl LoadOrder {
    pub(super) fn new(chunks: usize, per_chunk: usize) -> Self {
        // A power of two, so a dense id splits into chunk and place by a shift and a mask.
        let per_chunk = per_chunk.max(1).next_power_of_two();
        let group = (1..=GROUP.min(per_chunk))
            .rev()
            .find(|&g| per_chunk.is_multiple_of(g))
            .unwrap_or(1);
        LoadOrder {
            per_chunk,
            shift: per_chunk.trailing_zeros(),
            group,
            chunks: (0..chunks).map(|_| OnceLock::new()).collect(),
            tops: (0..chunks)
                .map(|_| AtomicU64::new(word(bound_of(f64::INFINITY), 0)))
                .collect(),
            params: [
                AtomicU64::new(1f64.to_bits()),
                AtomicU64::new(16),
                AtomicU64::new(0f64.to_bits()),
            ],
            state: AtomicU64::new(0),
            rekeying: Mutex::new(()),
        }
    }

    /// The parameters keys are computed with now.
    pub(super) fn params(&self) -> KeyParams {
        KeyParams {
            prefill_load_scale: f64::from_bits(self.params[0].load(Ordering::Acquire)),
            block_size: self.params[1].load(Ordering::Acquire) as u32,
            per_request: f64::from_bits(self.params[2].load(Ordering::Acquire)),
        }
    }

    /// Whether every key is computed with `p` (no rekey under way).
    pub(super) fn keyed_with(&self, p: &KeyParams) -> bool {
        self.state.load(Ordering::Acquire) & 1 == 0 && self.params() == *p
    }

    /// Chunk `c`, made (every key +∞) on first use.
    fn chunk_init(&self, c: usize) -> Option<&Chunk> {
        Some(self.chunks.get(c)?.get_or_init(|| {
            Chunk {
                keys: (0..self.per_chunk)
                    .map(|_| AtomicU64::new(f64::INFINITY.to_bits()))
                    .collect(),
                groups: (0..self.per_chunk / self.group)
                    .map(|_| AtomicU64::new(word(bound_of(f64::INFINITY), 0)))
                    .collect(),
            }
        }))
    }

    /// Chunks spanning the first `len` dense ids.
    fn chunk_count(&self, len: usize) -> usize {
        len.div_ceil(self.per_chunk).min(self.chunks.len())
    }

    /// Group `g` of chunk `c` (numbered within it): its word and its keys among the first `len`
    /// dense ids (None: the chunk was never written).
    fn group(&self, c: usize, g: usize, len: usize) -> Option<(&AtomicU64, &[AtomicU64])> {
        let chunk = self.chunks.get(c)?.get()?;
        let base = c * self.per_chunk + g * self.group;
        let n = len.saturating_sub(base).min(self.group);
        let at = g * self.group;
        Some((chunk.groups.get(g)?, chunk.keys.get(at..at + n)?))
    }

    /// Dense id `id`'s chunk and place in it.
    #[inline]
    fn split(&self, id: u32) -> (usize, usize) {
        let id = id as usize;
        (id >> self.shift, id & (self.per_chunk - 1))
    }

    /// Stores the key of dense id `id` for its view `v` (the caller holds the rank's cell lock).
    /// A key that fell lowers its group's bound and its chunk's, in that order, moving both
    /// versions on; a key that did not fall leaves them alone (they still hold, and a visit
    /// that read the old key raises a bound only to what it found).
    pub(super) fn set(&self, id: u32, v: &RankView) {
        let key = self.params().key(v);
        let (c, at) = self.split(id);
        let (Some(chunk), Some(top)) = (self.chunk_init(c), self.tops.get(c)) else {
            return;
        };
        let old = f64::from_bits(chunk.keys[at].swap(key.to_bits(), Ordering::AcqRel));
        if key >= old {
            return;
        }
        let b = bound_of(key);
        if let Some(g) = chunk.groups.get(at / self.group) {
            lower(g, b);
        }
        lower(top, b);
    }

    /// Rekeys every rank with `p`: `each(id)` must call [`Self::set`] for each dense id below
    /// `len` under its cell lock. One rekey at a time; false if another is under way.
    pub(super) fn rekey(&self, p: &KeyParams, len: usize, mut each: impl FnMut(u32)) -> bool {
        let Some(_one) = self.rekeying.try_lock() else {
            return false;
        };
        self.state.fetch_add(1, Ordering::AcqRel);
        self.params[0].store(p.prefill_load_scale.to_bits(), Ordering::Release);
        self.params[1].store(u64::from(p.block_size), Ordering::Release);
        self.params[2].store(p.per_request.to_bits(), Ordering::Release);
        for id in 0..len {
            each(id as u32);
        }
        self.state.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// A lower bound of every key of the first `len` dense ids.
    pub(super) fn least(&self, len: usize) -> f64 {
        self.tops[..self.chunk_count(len)]
            .iter()
            .map(|w| (w.load(Ordering::Acquire) >> 32) as u32)
            .min()
            .map_or(f64::INFINITY, key_of_bound)
    }

    /// A dense id below `len` of least key (None: none has a finite key), or nearly: the least
    /// key of the group of least bound in the chunk of least bound (stale bounds may mislead).
    pub(super) fn least_id(&self, len: usize) -> Option<u32> {
        let c = (0..self.chunk_count(len))
            .min_by_key(|&c| self.tops[c].load(Ordering::Acquire) >> 32)?;
        let chunk = self.chunks[c].get()?;
        let g = (0..chunk.groups.len())
            .min_by_key(|&g| chunk.groups[g].load(Ordering::Acquire) >> 32)?;
        let (_, keys) = self.group(c, g, len)?;
        let (at, key) = keys
            .iter()
            .map(|k| f64::from_bits(k.load(Ordering::Acquire)))
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        key.is_finite()
            .then_some((c * self.per_chunk + g * self.group + at) as u32)
    }

    /// The key of dense id `id` (+∞ if none).
    #[inline]
    pub(super) fn key(&self, id: u32) -> f64 {
        self.reader().key(id)
    }

    /// A reader of keys one after another ([`KeyReader`]).
    pub(super) fn reader(&self) -> KeyReader<'_> {
        KeyReader {
            order: self,
            chunk: usize::MAX,
            keys: &[],
        }
    }

    /// Calls `visit(id, key)` for every dense id below `len` whose key is at most the limit,
    /// in order of key: `limit` at first, then what the last visit returned (a visit may lower
    /// it, never raise it: what was left unread under a lower limit stays unread). Chunks and
    /// groups are read only when their bound is the least of what is left and within the
    /// limit, so a visit that stops early reads a few groups, however many ranks there are;
    /// reading a group's keys (or a chunk's group bounds) raises its bound to the least found.
    pub(super) fn visit(
        &self,
        len: usize,
        limit: f64,
        scratch: &mut VisitScratch,
        mut visit: impl FnMut(u32, f64) -> f64,
    ) {
        // Left empty by the last visit: no heapify.
        let mut heap = BinaryHeap::from(std::mem::take(&mut scratch.0));
        let mut lim = limit;
        for (c, w) in self.tops[..self.chunk_count(len)].iter().enumerate() {
            let b = key_of_bound((w.load(Ordering::Acquire) >> 32) as u32);
            if b <= lim {
                heap.push(Reverse((b.to_bits(), CHUNK_TAG | c as u32)));
            }
        }
        while let Some(Reverse((bits, tag))) = heap.pop() {
            let v = f64::from_bits(bits);
            if v > lim {
                break;
            }
            let n = (tag & NUMBER) as usize;
            match tag & !NUMBER {
                RANK => lim = visit(n as u32, v),
                GROUP_TAG => self.read_group(n, len, lim, &mut heap),
                _ => self.read_chunk(n, len, lim, &mut heap),
            }
        }
        scratch.0 = heap.into_vec();
        scratch.0.clear();
    }

    /// A visit reads chunk `c`: its groups within `lim` go on the heap; its bound is raised.
    fn read_chunk(
        &self,
        c: usize,
        len: usize,
        lim: f64,
        heap: &mut BinaryHeap<Reverse<(u64, u32)>>,
    ) {
        let Some(chunk) = self.chunks.get(c).and_then(OnceLock::get) else {
            return;
        };
        let seen = self.tops[c].load(Ordering::Acquire);
        let groups = (len.saturating_sub(c * self.per_chunk)).div_ceil(self.group);
        let mut least = u32::MAX;
        for (g, w) in chunk.groups.iter().take(groups).enumerate() {
            let b = (w.load(Ordering::Acquire) >> 32) as u32;
            least = least.min(b);
            let k = key_of_bound(b);
            if k <= lim {
                let n = c * (self.per_chunk / self.group) + g;
                heap.push(Reverse((k.to_bits(), GROUP_TAG | n as u32)));
            }
        }
        raise(&self.tops[c], seen, least);
    }

    /// A visit reads group `n` (numbered over all chunks): its keys within `lim` go on the heap;
    /// its bound is raised.
    fn read_group(
        &self,
        n: usize,
        len: usize,
        lim: f64,
        heap: &mut BinaryHeap<Reverse<(u64, u32)>>,
    ) {
        let per = self.per_chunk / self.group;
        let (c, g) = (n / per, n % per);
        let Some((w, keys)) = self.group(c, g, len) else {
            return;
        };
        let seen = w.load(Ordering::Acquire);
        let base = c * self.per_chunk + g * self.group;
        let mut least = f64::INFINITY;
        for (at, k) in keys.iter().enumerate() {
            let key = f64::from_bits(k.load(Ordering::Acquire));
            least = least.min(key);
            if key <= lim {
                heap.push(Reverse((key.to_bits(), RANK | (base + at) as u32)));
            }
        }
        raise(w, seen, bound_of(least));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::WorkerRank;

    fn view(prefill_tokens: u64, decode_blocks: u64) -> RankView {
        let rank = WorkerRank {
            worker: 1,
            dp_rank: 0,
        };
        let mut state = super::super::RankState::new(rank);
        state.prefill_tokens = prefill_tokens;
        let mut v = state.view();
        v.decode_blocks = decode_blocks;
        v
    }

    /// A visit that read a group (or a chunk) before a writer lowered a key must not raise its
    /// bound above that key; one that nobody disturbed does raise it (so visits skip it again);
    /// a visit yields the keys within its limit least first.
    #[test]
    fn a_raise_never_hides_a_key_stored_during_the_scan() {
        let order = LoadOrder::new(2, 4);
        assert_eq!(order.group, 4);
        for id in 0..4 {
            order.set(id, &view(0, 100));
        }
        order.set(0, &view(0, 1));
        order.set(0, &view(0, 100));
        let g = &order.chunks[0].get().unwrap().groups[0];
        let bound = |w: &AtomicU64| key_of_bound((w.load(Ordering::Acquire) >> 32) as u32);
        let stale = g.load(Ordering::Acquire);
        assert_eq!(bound(g), 1.0, "stale low until a scan");
        // Undisturbed: raised to the true least key.
        raise(g, stale, bound_of(100.0));
        assert_eq!(bound(g), 100.0);
        // A scan read the word, then a writer stored key 5: the scan's raise is refused.
        order.set(1, &view(0, 1));
        order.set(1, &view(0, 100));
        let seen = g.load(Ordering::Acquire);
        order.set(2, &view(0, 5));
        raise(g, seen, bound_of(100.0));
        assert!(bound(g) <= 5.0, "group bound above a stored key");
        // Likewise a chunk's bound, even when the key that fell was above it.
        let top = &order.tops[0];
        let seen = top.load(Ordering::Acquire);
        order.set(3, &view(0, 50));
        raise(top, seen, bound_of(100.0));
        assert!(bound(top) <= 5.0, "chunk bound above a stored key");
        order.set(3, &view(0, 2));
        let mut seen_ids = Vec::new();
        order.visit(4, 10.0, &mut VisitScratch::default(), |id, _| {
            seen_ids.push(id);
            10.0
        });
        assert_eq!(seen_ids, [3, 2], "least key first");
    }
}
