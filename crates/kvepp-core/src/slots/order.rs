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
//! chunks); each group of 64 dense ids has one word holding a lower bound of its keys (the top
//! 32 bits of the least key's `f64`, which order like the keys themselves for keys ≥ 0) and a
//! version.
//!
//! Invariants:
//! - a group's bound never exceeds the key of any rank in it: a writer whose key fell stores
//!   it, then lowers the bound to it if needed and bumps the version (a key that rose leaves the
//!   word alone: the bound still holds); a reader that found the group's true least key while
//!   scanning raises the bound only if no writer lowered a key since it read the word (same
//!   version), so a raise never hides a key stored meanwhile;
//! - a free dense id's key is +∞ (never visited);
//! - keys are computed with the parameters [`LoadOrder::params`] names; while they change
//!   ([`LoadOrder::rekey`]), [`LoadOrder::keyed_with`] answers false and picks read every rank.
//!
//! Keys are read and written without a lock (the writer of a rank's key holds that rank's cell
//! lock, so writers of one key are one at a time); what a visit reads is not one snapshot, like
//! everything a pick reads of the tracker.

use parking_lot::Mutex;
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

/// Ranks a bound word covers: a pick skips them together, and bookings on ranks of different
/// groups never write the same word.
const GROUP: usize = 64;

/// See the module documentation.
#[derive(Debug)]
pub(super) struct LoadOrder {
    per_chunk: usize,
    /// Ranks per bound word (divides `per_chunk`).
    group: usize,
    keys: Box<[OnceLock<Box<[AtomicU64]>>]>,
    /// Per group of ranks: its bound (high half) and version (low half).
    words: Box<[AtomicU64]>,
    /// The parameters keys are computed with (f64 bits, block size, f64 bits) and whether a
    /// rekey is under way (odd `state`).
    params: [AtomicU64; 3],
    state: AtomicU64,
    rekeying: Mutex<()>,
}

impl LoadOrder {
    pub(super) fn new(chunks: usize, per_chunk: usize) -> Self {
        let group = (1..=GROUP.min(per_chunk))
            .rev()
            .find(|&g| per_chunk.is_multiple_of(g))
            .unwrap_or(1);
        LoadOrder {
            per_chunk,
            group,
            keys: (0..chunks).map(|_| OnceLock::new()).collect(),
            words: (0..chunks * per_chunk / group)
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

    fn chunk_keys(&self, chunk: usize) -> Option<&[AtomicU64]> {
        let keys = self.keys.get(chunk)?.get_or_init(|| {
            (0..self.per_chunk)
                .map(|_| AtomicU64::new(f64::INFINITY.to_bits()))
                .collect()
        });
        Some(keys)
    }

    /// The keys of group `g`'s first `len` dense ids in all (None: never written).
    fn group_keys(&self, g: usize, len: usize) -> Option<&[AtomicU64]> {
        let base = g * self.group;
        let keys = self.keys.get(base / self.per_chunk)?.get()?;
        let at = base % self.per_chunk;
        let n = len.saturating_sub(base).min(self.group);
        keys.get(at..at + n)
    }

    /// Groups spanning the first `len` dense ids.
    fn groups(&self, len: usize) -> usize {
        len.div_ceil(self.group).min(self.words.len())
    }

    /// The group of least bound among the first `len` dense ids' (None: none).
    fn least_group(&self, len: usize) -> Option<usize> {
        (0..self.groups(len)).min_by_key(|&g| self.bound(g))
    }

    /// The bound of group `g` as read now.
    fn bound(&self, g: usize) -> u32 {
        (self.words[g].load(Ordering::Acquire) >> 32) as u32
    }

    /// Stores the key of dense id `id` for its view `v` (the caller holds the rank's cell lock).
    /// A key that did not fall leaves the group's word alone: the bound still holds, and a scan
    /// that read the old key may raise the bound only to what it found, at most the new key.
    pub(super) fn set(&self, id: u32, v: &RankView) {
        let key = self.params().key(v);
        let (chunk, at) = (id as usize / self.per_chunk, id as usize % self.per_chunk);
        let (Some(keys), Some(w)) = (
            self.chunk_keys(chunk),
            self.words.get(id as usize / self.group),
        ) else {
            return;
        };
        let old = f64::from_bits(keys[at].swap(key.to_bits(), Ordering::AcqRel));
        if key >= old {
            return;
        }
        let b = bound_of(key);
        let mut old = w.load(Ordering::Relaxed);
        loop {
            let new = word(((old >> 32) as u32).min(b), (old as u32).wrapping_add(1));
            match w.compare_exchange_weak(old, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => break,
                Err(x) => old = x,
            }
        }
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
        (0..self.groups(len))
            .map(|g| self.bound(g))
            .min()
            .map_or(f64::INFINITY, key_of_bound)
    }

    /// A dense id below `len` of least key (None: none has a finite key): the least key of the
    /// group of least bound, which holds it unless the bound is stale.
    pub(super) fn least_id(&self, len: usize) -> Option<u32> {
        let g = self.least_group(len)?;
        let (at, key) = self
            .group_keys(g, len)?
            .iter()
            .map(|k| f64::from_bits(k.load(Ordering::Acquire)))
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        key.is_finite().then_some((g * self.group + at) as u32)
    }

    /// The key of dense id `id` (+∞ if none).
    pub(super) fn key(&self, id: u32) -> f64 {
        let (chunk, at) = (id as usize / self.per_chunk, id as usize % self.per_chunk);
        self.keys
            .get(chunk)
            .and_then(OnceLock::get)
            .and_then(|k| k.get(at))
            .map_or(f64::INFINITY, |k| f64::from_bits(k.load(Ordering::Acquire)))
    }

    /// Calls `visit(id, key)` for every dense id below `len` whose key is at most the limit,
    /// `limit` at first and then what the last visit returned (a visit may lower it), starting
    /// with the group of least bound; groups whose bound is above the limit are skipped unread.
    pub(super) fn visit(&self, len: usize, limit: f64, mut visit: impl FnMut(u32, f64) -> f64) {
        let groups = self.groups(len);
        let Some(first) = self.least_group(len) else {
            return;
        };
        let mut lim = self.visit_group(first, len, limit, &mut visit);
        for g in (0..groups).filter(|&g| g != first) {
            lim = self.visit_group(g, len, lim, &mut visit);
        }
    }

    /// [`Self::visit`] over group `g`; the limit after it.
    fn visit_group(
        &self,
        g: usize,
        len: usize,
        mut lim: f64,
        visit: &mut impl FnMut(u32, f64) -> f64,
    ) -> f64 {
        let seen = self.words[g].load(Ordering::Acquire);
        if key_of_bound((seen >> 32) as u32) > lim {
            return lim;
        }
        let Some(keys) = self.group_keys(g, len) else {
            return lim;
        };
        let base = g * self.group;
        let mut least = f64::INFINITY;
        for (at, k) in keys.iter().enumerate() {
            let key = f64::from_bits(k.load(Ordering::Acquire));
            least = least.min(key);
            if key <= lim {
                lim = visit((base + at) as u32, key);
            }
        }
        self.raise(g, seen, least);
        lim
    }

    /// Raises group `g`'s bound to `least` (the least key a scan found, having read the word
    /// `seen` before it), unless a writer lowered a key since (the version moved on) or it is
    /// not higher.
    fn raise(&self, g: usize, seen: u64, least: f64) {
        let b = bound_of(least);
        if b > (seen >> 32) as u32 {
            let _ = self.words[g].compare_exchange(
                seen,
                word(b, seen as u32),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
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

    /// A scan that read the chunk before a writer lowered a key must not raise the bound above
    /// that key; one that nobody disturbed does raise it (so visits skip the chunk again).
    #[test]
    fn a_raise_never_hides_a_key_stored_during_the_scan() {
        let order = LoadOrder::new(2, 4);
        assert_eq!(order.group, 4);
        for id in 0..4 {
            order.set(id, &view(0, 100));
        }
        order.set(0, &view(0, 1));
        order.set(0, &view(0, 100));
        let stale = order.words[0].load(Ordering::Acquire);
        assert_eq!(
            key_of_bound((stale >> 32) as u32),
            1.0,
            "stale low until a scan"
        );
        // Undisturbed: raised to the true least key.
        order.raise(0, stale, 100.0);
        let w = order.words[0].load(Ordering::Acquire);
        assert_eq!(key_of_bound((w >> 32) as u32), 100.0);
        // A scan read the word, then a writer stored key 5: the scan's raise is refused.
        order.set(1, &view(0, 1));
        order.set(1, &view(0, 100));
        let seen = order.words[0].load(Ordering::Acquire);
        order.set(2, &view(0, 5));
        order.raise(0, seen, 100.0);
        let w = order.words[0].load(Ordering::Acquire);
        assert!(
            key_of_bound((w >> 32) as u32) <= 5.0,
            "bound above a stored key"
        );
        let mut seen_ids = Vec::new();
        order.visit(4, 10.0, |id, _| {
            seen_ids.push(id);
            10.0
        });
        assert_eq!(seen_ids, [2]);
    }
}
