//! The block hashes of recent prompts, so that a prompt which starts like one of them (a
//! conversation's next turn carries the whole previous turn; many requests share a long system
//! prompt) hashes only its blocks after the common part. On a 100k-token prompt that turns ~6,000
//! xxh3 calls into one comparison of the two prompts and the new blocks.
//!
//! The same memo serves approximate prompts (`PrefixMemo<u8>`): a text's bytes in place of
//! tokens, blocks of a fixed number of bytes, hashed as they are. A long document or a
//! conversation sent again as text then costs one comparison with the text it starts like.
//!
//! A prompt comes as one array of ids, or as the pieces it was assembled from (a chat's segments,
//! each from the tokenizer's segment cache, shared rather than copied: [`PrefixMemo::hashes_shared`]).
//! Two prompts are compared piece against piece: pieces that are the same allocation at the same
//! position are equal without reading them (a conversation's earlier turns come from the segment
//! cache as the very pieces its previous turn was remembered with), so comparing a 100k-token
//! turn with its previous one reads only its lengths; any other pair is compared token for token.
//!
//! Prompts are spread over a few sets by their first block's local hash; a set keeps the last
//! few prompts seen there (tokens, local and sequence hashes). A prompt reads from the one that
//! is a prefix of it (its previous turn: the last block checked first, then the whole), else
//! from the set's most recently used one (a shared document or system prompt), and is remembered
//! in place of the one it extends, else in place of the least recently used. So a long shared
//! start is reused by every prompt that has it, and up to `WAYS` conversations interleaving behind
//! one system prompt each reuse their own history.
//!
//! A lent prompt (one the caller keeps) is remembered as pieces: the part it shares with the entry
//! it read from is that entry's own memory, shared, and only the rest is copied; a next turn adds
//! its new part as a piece in place. So a prompt is copied at most once, and a shared document
//! sent again with another ending costs the copy of its ending.
//!
//! Invariants: every hashing call returns exactly what [`super::local_block_hashes`] and
//! [`super::sequence_hashes`] return for the same tokens (a differential test checks it); an
//! entry's hashes are reused only for blocks whose tokens, seed and block size equal the prompt's
//! (compared piece by piece, never by hash: a remembered piece is held by its entry, so no other
//! allocation can have its address while it is compared); an entry another pick is using is
//! skipped, never waited for; an entry's pieces use at least half of each allocation they hold,
//! so memory is bounded by twice `SETS × WAYS × MAX_BYTES` of prompts, and their hashes.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::{block_seed, chained, push_local_hashes, LocalBlockHash, SequenceHash};

/// Sets (chosen by a prompt's first block) and prompts remembered per set.
const SETS: usize = 4;
const WAYS: usize = 4;
/// Prompts with fewer full blocks are hashed directly (the memo would save little).
const MIN_BLOCKS: usize = 32;
/// Prompts larger than this are hashed but not remembered (memory bound: 1 MiB of tokens and
/// 0.5 MiB of hashes an entry at block size 16; 1 MiB of text and 0.25 MiB of hashes at 64-byte
/// blocks).
const MAX_BYTES: usize = 1 << 20;

/// What a remembered prompt is made of, and how whole blocks of it are hashed: token ids
/// (Dynamo's local hashes of their little-endian bytes) or a text's bytes (approximate blocks:
/// xxh3 of the bytes themselves).
pub trait Unit: Copy + PartialEq + Default + std::fmt::Debug + Send + Sync + 'static {
    /// Appends the local hashes of the full blocks of `run` (`block_size` > 0) under `seed`.
    fn push_hashes(run: &[Self], block_size: usize, seed: u64, out: &mut Vec<LocalBlockHash>);
}

impl Unit for u32 {
    fn push_hashes(run: &[u32], block_size: usize, seed: u64, out: &mut Vec<LocalBlockHash>) {
        push_local_hashes(run, block_size, seed, out);
    }
}

impl Unit for u8 {
    fn push_hashes(run: &[u8], block_size: usize, seed: u64, out: &mut Vec<LocalBlockHash>) {
        out.extend(
            run.chunks_exact(block_size)
                .map(|block| LocalBlockHash(xxh3_64_with_seed(block, seed))),
        );
    }
}

/// The most units of `T` a remembered prompt may have.
const fn max_units<T>() -> usize {
    MAX_BYTES / std::mem::size_of::<T>()
}

#[derive(Debug, Default)]
struct Entry<T> {
    seed: u64,
    block_size: usize,
    /// The remembered prompt's tokens: its own array, or (when `pieces` is not empty) pieces
    /// shared with whoever else holds them (a chat's segments; the part a lent prompt shares with
    /// the entry it read from); either way only the first `len` tokens count (its full blocks).
    flat: Vec<T>,
    pieces: Vec<Piece<T>>,
    len: usize,
    locals: Vec<LocalBlockHash>,
    /// The very list the prompt's request was given (shared, not copied).
    hashes: Arc<[SequenceHash]>,
    /// The set's clock when it was last read or written (0: never).
    used: u64,
}

impl<T: Unit> Entry<T> {
    /// Whether its hashes can serve a prompt under `seed` and `block_size`.
    fn fits(&self, seed: u64, block_size: usize) -> bool {
        self.used > 0 && self.seed == seed && self.block_size == block_size
    }

    /// Its tokens' pieces (the last may run past `len`).
    fn parts(&self) -> Parts<'_, T> {
        if self.pieces.is_empty() {
            Parts::One([&self.flat[..self.len.min(self.flat.len())]])
        } else {
            Parts::Many(self.pieces.iter().map(Piece::units).collect())
        }
    }

    /// Whether it may be a prefix of `full` (`full_len` tokens): it fits and its last block
    /// equals `full`'s block at the same position (the whole comparison decides).
    fn may_lead(&self, full: &[&[T]], full_len: usize, seed: u64, block_size: usize) -> bool {
        let n = self.len;
        self.fits(seed, block_size)
            && n >= block_size
            && n <= full_len
            && tokens_from(self.parts().as_slice(), n - block_size)
                .take(block_size)
                .eq(tokens_from(full, n - block_size).take(block_size))
    }
}

/// A run of a remembered prompt: the first `end` units of an allocation that other entries (or
/// the tokenizer's segment cache) may share.
#[derive(Debug, Clone)]
struct Piece<T> {
    data: Arc<[T]>,
    end: usize,
}

impl<T> Piece<T> {
    fn whole(data: Arc<[T]>) -> Self {
        let end = data.len();
        Piece { data, end }
    }

    fn units(&self) -> &[T] {
        &self.data[..self.end]
    }
}

/// A lent prompt kept in more pieces than this is joined into one (copied): a conversation
/// remembered turn by turn adds a piece a turn.
const MAX_PIECES: usize = 32;

/// The first `n` units of `pieces`: the pieces wholly inside shared as they are, the one `n` cuts
/// through shared up to the cut while that keeps at least half of its allocation, else copied (so
/// an entry never holds more than twice the memory its tokens need).
fn cut<T: Copy>(pieces: &[Piece<T>], n: usize) -> Vec<Piece<T>> {
    let mut out = Vec::with_capacity(pieces.len() + 1);
    let mut pos = 0;
    for p in pieces {
        if pos >= n {
            break;
        }
        let take = p.end.min(n - pos);
        out.push(if take * 2 >= p.data.len() {
            Piece {
                data: p.data.clone(),
                end: take,
            }
        } else {
            Piece::whole(Arc::from(&p.data[..take]))
        });
        pos += take;
    }
    out
}

/// A sequence of token pieces, without allocating for the common one-piece case.
enum Parts<'a, T> {
    One([&'a [T]; 1]),
    Many(Vec<&'a [T]>),
}

impl<'a, T> Parts<'a, T> {
    fn as_slice(&self) -> &[&'a [T]] {
        match self {
            Parts::One(p) => p,
            Parts::Many(p) => p,
        }
    }
}

/// The tokens of `parts` from position `at` on.
fn tokens_from<'a, T: Copy>(parts: &'a [&'a [T]], at: usize) -> impl Iterator<Item = T> + 'a {
    let mut skip = at;
    parts
        .iter()
        .flat_map(move |p| {
            let s = skip.min(p.len());
            skip -= s;
            &p[s..]
        })
        .copied()
}

/// How many leading tokens `a` and `b` share (within `limit`): pieces that are one allocation at
/// the same place are skipped unread, the rest compared a run at a time.
fn common_tokens<T: PartialEq>(a: &[&[T]], b: &[&[T]], limit: usize) -> usize {
    let (mut ia, mut oa, mut ib, mut ob, mut n) = (0, 0, 0, 0, 0);
    while n < limit {
        let (Some(pa), Some(pb)) = (a.get(ia), b.get(ib)) else {
            break;
        };
        let (x, y) = (&pa[oa..], &pb[ob..]);
        let m = x.len().min(y.len()).min(limit - n);
        let same = if std::ptr::eq(x.as_ptr(), y.as_ptr()) {
            m
        } else {
            common_prefix(&x[..m], &y[..m])
        };
        n += same;
        if same < m {
            break;
        }
        (oa, ob) = (oa + m, ob + m);
        if oa == pa.len() {
            (ia, oa) = (ia + 1, 0);
        }
        if ob == pb.len() {
            (ib, ob) = (ib + 1, 0);
        }
    }
    n
}

/// The length of the common prefix of two slices: long runs first (one memcmp each for plain
/// data such as tokens or bytes), then element by element inside the run that differs.
pub fn common_prefix<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    const RUN: usize = 1024;
    let end = a.len().min(b.len());
    let mut i = 0;
    while i + RUN <= end && a[i..i + RUN] == b[i..i + RUN] {
        i += RUN;
    }
    while i < end && a[i] == b[i] {
        i += 1;
    }
    i
}

/// Hashes the full blocks of `parts` from token `from` to `to` (multiples of `block_size`)
/// after those already in `locals`: whole runs inside a piece directly, a block that spans two
/// pieces gathered first.
fn hash_range<T: Unit>(
    parts: &[&[T]],
    (from, to): (usize, usize),
    block_size: usize,
    seed: u64,
    locals: &mut Vec<LocalBlockHash>,
) {
    let mut carry: Vec<T> = Vec::new();
    let mut pos = 0;
    for p in parts {
        let (start, end) = (pos, pos + p.len());
        pos = end;
        let (a, b) = (start.max(from), end.min(to));
        if a >= b {
            continue;
        }
        let mut s = &p[a - start..b - start];
        if !carry.is_empty() {
            let take = (block_size - carry.len()).min(s.len());
            carry.extend_from_slice(&s[..take]);
            s = &s[take..];
            if carry.len() == block_size {
                T::push_hashes(&carry, block_size, seed, locals);
                carry.clear();
            }
        }
        let whole = s.len() / block_size * block_size;
        if whole > 0 {
            T::push_hashes(&s[..whole], block_size, seed, locals);
        }
        carry.extend_from_slice(&s[whole..]);
    }
}

#[derive(Debug, Default)]
struct Set<T> {
    ways: [Entry<T>; WAYS],
    clock: u64,
}

/// Recent prompts' block hashes (see the module doc): of token prompts (`u32`, the default) or
/// of texts (`u8`, approximate blocks).
#[derive(Debug)]
pub struct PrefixMemo<T = u32> {
    sets: Box<[Mutex<Set<T>>]>,
    /// Blocks whose hashes were copied from an entry, and blocks hashed.
    reused: AtomicU64,
    hashed: AtomicU64,
}

/// How a [`PrefixMemo`]'s prompts got their block hashes, since it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoStats {
    pub blocks_reused: u64,
    pub blocks_hashed: u64,
}

impl std::ops::Add for MemoStats {
    type Output = MemoStats;
    fn add(self, o: MemoStats) -> MemoStats {
        MemoStats {
            blocks_reused: self.blocks_reused + o.blocks_reused,
            blocks_hashed: self.blocks_hashed + o.blocks_hashed,
        }
    }
}

impl<T: Unit> Default for PrefixMemo<T> {
    fn default() -> Self {
        PrefixMemo {
            sets: (0..SETS).map(|_| Mutex::default()).collect(),
            reused: AtomicU64::new(0),
            hashed: AtomicU64::new(0),
        }
    }
}

/// A prompt's tokens, lent or handed over for the memo to keep.
enum Tokens<'a, T> {
    Borrowed(&'a [T]),
    Owned(Vec<T>),
    Shared(Vec<Arc<[T]>>),
}

impl<T> Tokens<'_, T> {
    fn parts(&self) -> Parts<'_, T> {
        match self {
            Tokens::Borrowed(t) => Parts::One([t]),
            Tokens::Owned(t) => Parts::One([t]),
            Tokens::Shared(p) => Parts::Many(p.iter().map(|p| &p[..]).collect()),
        }
    }
}

impl PrefixMemo {
    /// Local and sequence hashes of the full blocks of `tokens` (Dynamo's, seeded by `lora`), from
    /// the remembered prompt that shares the most leading blocks, and remembered for the next
    /// (its tokens copied).
    pub fn hashes(
        &self,
        tokens: &[u32],
        block_size: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        self.count(self.hashes_counting_reuse(
            Tokens::Borrowed(tokens),
            block_size,
            block_seed(lora),
        ))
    }

    /// [`Self::hashes`] of tokens the caller has no further use for: they are remembered as they
    /// are, not copied (on a 100k-token prompt that saves writing 400 KB per request).
    pub fn hashes_owned(
        &self,
        tokens: Vec<u32>,
        block_size: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        self.count(self.hashes_counting_reuse(Tokens::Owned(tokens), block_size, block_seed(lora)))
    }

    /// [`Self::hashes`] of the tokens of `pieces` one after another (a chat's segments as the
    /// tokenizer's cache holds them): never gathered into one array, remembered as the pieces
    /// themselves, and compared with a remembered prompt piece by piece (see the module doc).
    pub fn hashes_shared(
        &self,
        pieces: Vec<Arc<[u32]>>,
        block_size: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        self.count(self.hashes_counting_reuse(Tokens::Shared(pieces), block_size, block_seed(lora)))
    }
}

impl PrefixMemo<u8> {
    /// Approximate blocks of a text: local hashes of its full `block_size`-byte blocks under
    /// `seed`, and their chain, from the remembered text that shares the most leading blocks, and
    /// remembered for the next (its bytes copied, only those past the part it shares with the
    /// text it read from).
    pub fn text_hashes(
        &self,
        text: &[u8],
        block_size: usize,
        seed: u64,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        self.count(self.hashes_counting_reuse(Tokens::Borrowed(text), block_size, seed))
    }
}

impl<T: Unit> PrefixMemo<T> {
    fn count(
        &self,
        (locals, hashes, reused): (Vec<LocalBlockHash>, Arc<[SequenceHash]>, usize),
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        self.reused.fetch_add(reused as u64, Ordering::Relaxed);
        self.hashed
            .fetch_add((locals.len() - reused) as u64, Ordering::Relaxed);
        (locals, hashes)
    }

    /// How this memo's prompts got their block hashes so far.
    pub fn stats(&self) -> MemoStats {
        MemoStats {
            blocks_reused: self.reused.load(Ordering::Relaxed),
            blocks_hashed: self.hashed.load(Ordering::Relaxed),
        }
    }

    /// [`Self::hashes`], and how many blocks' hashes came from an entry.
    fn hashes_counting_reuse(
        &self,
        input: Tokens<'_, T>,
        block_size: usize,
        seed: u64,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>, usize) {
        let mut locals = Vec::new();
        if block_size == 0 {
            return (locals, Arc::from([]), 0);
        }
        let parts = input.parts();
        let full = parts.as_slice();
        let blocks = full.iter().map(|p| p.len()).sum::<usize>() / block_size;
        let full_len = blocks * block_size;
        locals.reserve_exact(blocks);
        // Hashes the blocks after those already in `locals`.
        let hash_rest = |locals: &mut Vec<LocalBlockHash>| {
            let from = locals.len() * block_size;
            hash_range(full, (from, full_len), block_size, seed, locals);
        };
        if blocks < MIN_BLOCKS {
            hash_rest(&mut locals);
            let hashes = chained(&locals, &[]);
            return (locals, hashes, 0);
        }
        // The first block picks the entry (its hash is needed anyway).
        hash_range(full, (0, block_size), block_size, seed, &mut locals);
        let at = (locals[0].0 >> 32) as usize % self.sets.len();
        let Some(mut set) = self.sets.get(at).and_then(|e| e.try_lock()) else {
            // Another pick is on this set (or it was poisoned): hash without it.
            hash_rest(&mut locals);
            let hashes = chained(&locals, &[]);
            return (locals, hashes, 0);
        };
        let set = &mut *set;
        set.clock += 1;
        let ways = &mut set.ways;
        // Read from the longest prompt that may lead this one, else the most recently used.
        let read = (0..WAYS)
            .filter(|&w| ways[w].may_lead(full, full_len, seed, block_size))
            .max_by_key(|&w| ways[w].len)
            .or_else(|| {
                (0..WAYS)
                    .filter(|&w| ways[w].fits(seed, block_size))
                    .max_by_key(|&w| ways[w].used)
            });
        let reuse = read.map_or(0, |w| {
            let e = &ways[w];
            common_tokens(e.parts().as_slice(), full, e.len.min(full_len)) / block_size
        });
        let known = match read {
            Some(w) if reuse > 1 => {
                locals.extend_from_slice(&ways[w].locals[1..reuse]);
                ways[w].used = set.clock;
                &ways[w].hashes[..reuse]
            }
            _ => &[],
        };
        let copied = locals.len() - 1;
        hash_rest(&mut locals);
        // Written once, where the request's booking shares it (no copy of the list).
        let hashes = chained(&locals, known);
        drop(parts);
        if full_len <= max_units::<T>() {
            // In place of the prompt this one extends, else of the least recently used.
            let extended = read.filter(|&w| reuse == ways[w].locals.len());
            let target = extended
                .or_else(|| (0..WAYS).min_by_key(|&w| ways[w].used))
                .unwrap_or(0);
            // The target's blocks that equal the prompt's stay; the rest is the prompt's. A lent
            // prompt that read from another entry shares that entry's memory for what they have
            // in common (a shared document sent again with another ending copies its ending).
            let keep = if read == Some(target) { reuse } else { 0 };
            let shared = match (read, &input) {
                (Some(w), Tokens::Borrowed(_)) if keep == 0 => {
                    cut(&ways[w].pieces, reuse * block_size)
                }
                _ => Vec::new(),
            };
            let e = &mut ways[target];
            e.seed = seed;
            e.block_size = block_size;
            e.remember(input, (keep * block_size, shared), full_len);
            e.locals.truncate(keep);
            e.locals.extend_from_slice(&locals[keep..]);
            e.hashes = hashes.clone();
            e.used = set.clock;
        }
        (locals, hashes, copied)
    }
}

impl<T: Unit> Entry<T> {
    /// Takes the prompt's first `len` tokens as its own, of which its first `keep` are already
    /// equal to the prompt's (kept in place) or, where it keeps none, the first of `shared` (the
    /// pieces of the entry the prompt read from, as far as the two are equal).
    fn remember(
        &mut self,
        input: Tokens<'_, T>,
        (keep, shared): (usize, Vec<Piece<T>>),
        len: usize,
    ) {
        match input {
            // Nothing to copy: the prompt's own tokens, cut to its full blocks (in place).
            Tokens::Owned(mut own) => {
                own.truncate(len);
                own.shrink_to_fit();
                self.flat = own;
                self.pieces.clear();
            }
            // Its own array, extended in place past the part it keeps.
            Tokens::Borrowed(full) if self.pieces.is_empty() && keep > 0 => {
                self.flat.truncate(keep);
                self.flat.extend_from_slice(&full[keep..len]);
            }
            // What it keeps or shares, then the rest copied as one new piece.
            Tokens::Borrowed(full) => {
                let mut pieces = if keep > 0 {
                    cut(&self.pieces, keep)
                } else {
                    shared
                };
                let from: usize = pieces.iter().map(|p| p.end).sum();
                if from < len {
                    pieces.push(Piece::whole(Arc::from(&full[from..len])));
                }
                if pieces.len() > MAX_PIECES {
                    pieces = vec![Piece::whole(Arc::from(&full[..len]))];
                }
                self.pieces = pieces;
                self.flat = Vec::new();
            }
            // The pieces themselves, shared with whoever else holds them.
            Tokens::Shared(pieces) => {
                self.pieces = pieces.into_iter().map(Piece::whole).collect();
                self.flat = Vec::new();
            }
        }
        self.len = len;
    }
}

#[cfg(test)]
mod tests;
