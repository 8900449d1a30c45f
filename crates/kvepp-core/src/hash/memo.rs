//! The block hashes of recent token prompts, so that a prompt which starts like one of them (a
//! conversation's next turn carries the whole previous turn; many requests share a long system
//! prompt) hashes only its blocks after the common part. On a 100k-token prompt that turns ~6,000
//! xxh3 calls into one comparison of the two prompts and the new blocks.
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
//! Invariants: every hashing call returns exactly what [`super::local_block_hashes`] and
//! [`super::sequence_hashes`] return for the same tokens (a differential test checks it); an
//! entry's hashes are reused only for blocks whose tokens, seed and block size equal the prompt's
//! (compared piece by piece, never by hash: a remembered piece is held by its entry, so no other
//! allocation can have its address while it is compared); an entry another pick is using is
//! skipped, never waited for; memory is bounded by `SETS × WAYS × MAX_TOKENS` tokens and their
//! hashes.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{block_seed, chained, push_local_hashes, LocalBlockHash, SequenceHash};

/// Sets (chosen by a prompt's first block) and prompts remembered per set.
const SETS: usize = 4;
const WAYS: usize = 4;
/// Prompts with fewer full blocks are hashed directly (the memo would save little).
const MIN_BLOCKS: usize = 32;
/// Prompts with more tokens than this are hashed but not remembered (memory bound: 1 MiB of
/// tokens and 0.5 MiB of hashes an entry at block size 16).
const MAX_TOKENS: usize = 256 << 10;

#[derive(Debug, Default)]
struct Entry {
    seed: u64,
    block_size: usize,
    /// The remembered prompt's tokens: its own array, or (when `pieces` is not empty) the shared
    /// pieces it was assembled from; either way only the first `len` tokens count (its full
    /// blocks).
    flat: Vec<u32>,
    pieces: Vec<Arc<[u32]>>,
    len: usize,
    locals: Vec<LocalBlockHash>,
    hashes: Vec<SequenceHash>,
    /// The set's clock when it was last read or written (0: never).
    used: u64,
}

impl Entry {
    /// Whether its hashes can serve a prompt under `seed` and `block_size`.
    fn fits(&self, seed: u64, block_size: usize) -> bool {
        self.used > 0 && self.seed == seed && self.block_size == block_size
    }

    /// Its tokens' pieces (the last may run past `len`).
    fn parts(&self) -> Parts<'_> {
        if self.pieces.is_empty() {
            Parts::One([&self.flat[..self.len.min(self.flat.len())]])
        } else {
            Parts::Many(self.pieces.iter().map(|p| &p[..]).collect())
        }
    }

    /// Whether it may be a prefix of `full` (`full_len` tokens): it fits and its last block
    /// equals `full`'s block at the same position (the whole comparison decides).
    fn may_lead(&self, full: &[&[u32]], full_len: usize, seed: u64, block_size: usize) -> bool {
        let n = self.len;
        self.fits(seed, block_size)
            && n >= block_size
            && n <= full_len
            && tokens_from(self.parts().as_slice(), n - block_size)
                .take(block_size)
                .eq(tokens_from(full, n - block_size).take(block_size))
    }
}

/// A sequence of token pieces, without allocating for the common one-piece case.
enum Parts<'a> {
    One([&'a [u32]; 1]),
    Many(Vec<&'a [u32]>),
}

impl<'a> Parts<'a> {
    fn as_slice(&self) -> &[&'a [u32]] {
        match self {
            Parts::One(p) => p,
            Parts::Many(p) => p,
        }
    }
}

/// The tokens of `parts` from position `at` on.
fn tokens_from<'a>(parts: &'a [&'a [u32]], at: usize) -> impl Iterator<Item = u32> + 'a {
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
fn common_tokens(a: &[&[u32]], b: &[&[u32]], limit: usize) -> usize {
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
fn hash_range(
    parts: &[&[u32]],
    (from, to): (usize, usize),
    block_size: usize,
    seed: u64,
    locals: &mut Vec<LocalBlockHash>,
) {
    let mut carry: Vec<u32> = Vec::new();
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
                push_local_hashes(&carry, block_size, seed, locals);
                carry.clear();
            }
        }
        let whole = s.len() / block_size * block_size;
        if whole > 0 {
            push_local_hashes(&s[..whole], block_size, seed, locals);
        }
        carry.extend_from_slice(&s[whole..]);
    }
}

#[derive(Debug, Default)]
struct Set {
    ways: [Entry; WAYS],
    clock: u64,
}

/// Recent prompts' block hashes (see the module doc).
#[derive(Debug)]
pub struct PrefixMemo {
    sets: Box<[Mutex<Set>]>,
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

impl Default for PrefixMemo {
    fn default() -> Self {
        PrefixMemo {
            sets: (0..SETS).map(|_| Mutex::default()).collect(),
            reused: AtomicU64::new(0),
            hashed: AtomicU64::new(0),
        }
    }
}

/// A prompt's tokens, lent or handed over for the memo to keep.
enum Tokens<'a> {
    Borrowed(&'a [u32]),
    Owned(Vec<u32>),
    Shared(Vec<Arc<[u32]>>),
}

impl Tokens<'_> {
    fn parts(&self) -> Parts<'_> {
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
        self.count(self.hashes_counting_reuse(Tokens::Borrowed(tokens), block_size, lora))
    }

    /// [`Self::hashes`] of tokens the caller has no further use for: they are remembered as they
    /// are, not copied (on a 100k-token prompt that saves writing 400 KB per request).
    pub fn hashes_owned(
        &self,
        tokens: Vec<u32>,
        block_size: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        self.count(self.hashes_counting_reuse(Tokens::Owned(tokens), block_size, lora))
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
        self.count(self.hashes_counting_reuse(Tokens::Shared(pieces), block_size, lora))
    }

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
        input: Tokens<'_>,
        block_size: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>, usize) {
        let mut locals = Vec::new();
        if block_size == 0 {
            return (locals, Arc::from([]), 0);
        }
        let parts = input.parts();
        let full = parts.as_slice();
        let blocks = full.iter().map(|p| p.len()).sum::<usize>() / block_size;
        let full_len = blocks * block_size;
        let seed = block_seed(lora);
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
        if full_len <= MAX_TOKENS {
            // In place of the prompt this one extends, else of the least recently used.
            let extended = read.filter(|&w| reuse == ways[w].locals.len());
            let target = extended
                .or_else(|| (0..WAYS).min_by_key(|&w| ways[w].used))
                .unwrap_or(0);
            // The target's blocks that equal the prompt's stay; the rest is the prompt's.
            let keep = if read == Some(target) { reuse } else { 0 };
            let e = &mut ways[target];
            e.seed = seed;
            e.block_size = block_size;
            e.remember(input, keep * block_size, full_len);
            e.locals.truncate(keep);
            e.locals.extend_from_slice(&locals[keep..]);
            e.hashes.truncate(keep);
            e.hashes.extend_from_slice(&hashes[keep..]);
            e.used = set.clock;
        }
        (locals, hashes, copied)
    }
}

impl Entry {
    /// Takes the prompt's first `len` tokens as its own, of which its first `keep` are already
    /// equal to the prompt's (kept in place where the entry holds its own array).
    fn remember(&mut self, input: Tokens<'_>, keep: usize, len: usize) {
        match input {
            // Nothing to copy: the prompt's own tokens, cut to its full blocks (in place).
            Tokens::Owned(mut own) => {
                own.truncate(len);
                own.shrink_to_fit();
                self.flat = own;
                self.pieces.clear();
            }
            Tokens::Borrowed(full) => {
                let keep = if self.pieces.is_empty() { keep } else { 0 };
                self.flat.truncate(keep.min(self.flat.len()));
                self.flat.extend_from_slice(&full[self.flat.len()..len]);
                self.pieces.clear();
            }
            // The pieces themselves, shared with whoever else holds them.
            Tokens::Shared(pieces) => {
                self.pieces = pieces;
                self.flat = Vec::new();
            }
        }
        self.len = len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{local_block_hashes, sequence_hashes};

    fn plain(
        tokens: &[u32],
        bs: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Arc<[SequenceHash]>) {
        let l = local_block_hashes(tokens, bs, lora);
        let s = sequence_hashes(&l);
        (l, s.into())
    }

    /// `old`'s pieces up to token `at` of `conv` (the piece holding `at` cut there, in a new
    /// allocation), then the rest of `conv` as one new piece.
    fn repiece(old: &[Arc<[u32]>], conv: &[u32], at: usize) -> Vec<Arc<[u32]>> {
        let mut out = Vec::new();
        let mut pos = 0;
        for p in old {
            if pos + p.len() <= at {
                out.push(p.clone());
                pos += p.len();
            } else {
                break;
            }
        }
        if pos < conv.len() {
            out.push(Arc::from(&conv[pos..]));
        }
        out
    }

    /// Every remembered prompt's hashes are those of its own tokens (what makes reusing them
    /// exact).
    fn assert_consistent(memo: &PrefixMemo) {
        for set in memo.sets.iter() {
            let set = set.lock();
            for e in set.ways.iter().filter(|e| e.used > 0) {
                let tokens: Vec<u32> = tokens_from(e.parts().as_slice(), 0).take(e.len).collect();
                assert_eq!(tokens.len(), e.len, "an entry holds its length");
                assert_eq!(
                    tokens.len(),
                    e.locals.len() * e.block_size,
                    "full blocks only"
                );
                let lora_free = e.seed == block_seed(None);
                let (l, h) = if lora_free {
                    plain(&tokens, e.block_size, None)
                } else {
                    plain(&tokens, e.block_size, Some("adapter"))
                };
                assert_eq!(
                    (&e.locals, &e.hashes[..]),
                    (&l, &h[..]),
                    "an entry's hashes are its tokens'"
                );
            }
        }
    }

    /// Differential test against hashing every prompt from scratch: conversations that grow turn
    /// by turn, share a system prompt (or land in an entry that holds another one), edit an early
    /// token, switch LoRA or block size, shrink, and prompts too short or too long to remember;
    /// each prompt lent or handed over at random.
    #[test]
    fn memo_hashes_equal_plain_hashes() {
        let memo = PrefixMemo::default();
        let mut rng = fastrand::Rng::with_seed(3);
        // 40 system prompts over 16 entries: prompts with other first blocks meet in an entry.
        let systems: Vec<Vec<u32>> = (0..40)
            .map(|_| (0..40 * 16).map(|_| rng.u32(..50_000)).collect())
            .collect();
        // Each conversation also as the pieces it was assembled from: the system prompt's piece
        // shared by every conversation that has it, each turn's added tokens a piece of its own
        // (as a chat's segments come from the tokenizer's cache), and now and then a piece copied
        // anew (equal tokens in another allocation, as after the cache evicted and re-tokenized
        // it).
        let shared_systems: Vec<Arc<[u32]>> = systems.iter().map(|s| Arc::from(&s[..])).collect();
        let mut conversations: Vec<Vec<u32>> = (0..60)
            .map(|i| systems[i % systems.len()].clone())
            .collect();
        let mut pieces: Vec<Vec<Arc<[u32]>>> = (0..60)
            .map(|i| vec![shared_systems[i % systems.len()].clone()])
            .collect();
        let (mut reused, mut blocks) = (0, 0);
        for step in 0..3_000 {
            let c = rng.usize(..conversations.len());
            let conv = &mut conversations[c];
            match rng.u8(..10) {
                0 => {
                    // An early edit: everything after it differs.
                    let i = rng.usize(..conv.len());
                    conv[i] ^= 1;
                    pieces[c] = repiece(&pieces[c], conv, i);
                }
                1 => {
                    let n = rng.usize(..conv.len() + 1);
                    conv.truncate(n);
                    pieces[c] = repiece(&pieces[c], conv, n);
                }
                2 if !pieces[c].is_empty() => {
                    let k = rng.usize(..pieces[c].len());
                    pieces[c][k] = Arc::from(&pieces[c][k][..]);
                }
                _ => {
                    let n = rng.usize(1..300);
                    let from = conv.len();
                    conv.extend((0..n).map(|_| rng.u32(..50_000)));
                    pieces[c].push(Arc::from(&conv[from..]));
                }
            }
            assert_eq!(
                pieces[c]
                    .iter()
                    .flat_map(|p| p.iter().copied())
                    .collect::<Vec<_>>(),
                *conv
            );
            let bs = if step % 50 == 49 { 8 } else { 16 };
            let lora = [None, None, None, Some("adapter")][rng.usize(..4)];
            let want = plain(conv, bs, lora);
            // Lent, handed over (the memo then keeps that very vector) or in pieces: the same
            // hashes.
            let got = match rng.u8(..4) {
                0 => memo.hashes(conv, bs, lora),
                1 => memo.hashes_owned(conv.clone(), bs, lora),
                _ => memo.hashes_shared(pieces[c].clone(), bs, lora),
            };
            blocks += want.0.len() as u64;
            if step % 50 == 0 {
                assert_consistent(&memo);
            }
            assert_eq!(
                got,
                want,
                "step {step}: conversation {c}, {} tokens",
                conv.len()
            );
            reused += usize::from(conv.len() / bs >= MIN_BLOCKS);
        }
        assert!(
            reused > 1_500,
            "{reused} prompts long enough to use the memo"
        );
        let stats = memo.stats();
        assert_eq!(stats.blocks_reused + stats.blocks_hashed, blocks);
        // 60 conversations over 16 entries, in random order: most turns find another
        // conversation in their entry, so reuse is the shared system prompt's at best.
        assert!(stats.blocks_reused > blocks / 10, "{stats:?} of {blocks}");
        // Too long to remember, and block size 0.
        let long: Vec<u32> = (0..MAX_TOKENS as u32 + 100).collect();
        assert_eq!(memo.hashes(&long, 16, None), plain(&long, 16, None));
        assert_eq!(memo.hashes(&long, 16, None), plain(&long, 16, None));
        assert_eq!(memo.hashes(&long, 0, None), (vec![], Arc::from([])));
        let (owned, zero) = (memo.hashes_owned(long.clone(), 16, None), long.clone());
        assert_eq!(owned, plain(&long, 16, None));
        assert_eq!(memo.hashes_owned(zero, 0, None), (vec![], Arc::from([])));
        assert_consistent(&memo);
    }

    /// Two prompts that differ only in their first block and meet in one entry: each is hashed as
    /// itself, whichever came before (the entry keeps no block of the other's).
    #[test]
    fn prompts_differing_only_in_their_first_block_do_not_mix() {
        let memo = PrefixMemo::default();
        let entry = |t: &[u32]| (local_block_hashes(&t[..16], 16, None)[0].0 >> 32) as usize % SETS;
        let rest: Vec<u32> = (100..100 + 16 * 40).collect();
        let x: Vec<u32> = (0..16).chain(rest.iter().copied()).collect();
        let y = (1_000u32..)
            .map(|k| {
                (k..k + 16)
                    .chain(rest.iter().copied())
                    .collect::<Vec<u32>>()
            })
            .find(|y| entry(y) == entry(&x))
            .expect("a first block for the same entry");
        for t in [&x, &y, &x, &y, &y, &x] {
            assert_eq!(memo.hashes(t, 16, None), plain(t, 16, None));
        }
    }

    /// Picks on several threads at once (entries busy, skipped, updated by whoever holds them):
    /// every answer still equals hashing from scratch.
    #[test]
    fn concurrent_picks_get_exact_hashes() {
        let memo = PrefixMemo::default();
        let system: Vec<u32> = (0..64 * 16).map(|i| i * 7 + 1).collect();
        std::thread::scope(|scope| {
            for t in 0..4u32 {
                let (memo, system) = (&memo, &system);
                scope.spawn(move || {
                    let mut rng = fastrand::Rng::with_seed(u64::from(t));
                    let mut conv = system.clone();
                    for _ in 0..300 {
                        if rng.u8(..8) == 0 {
                            conv.truncate(system.len());
                        }
                        conv.extend((0..rng.usize(1..100)).map(|_| rng.u32(..50_000)));
                        assert_eq!(memo.hashes(&conv, 16, None), plain(&conv, 16, None));
                    }
                });
            }
        });
    }

    /// Four conversations taking turns behind one long system prompt each keep their own history:
    /// after their first turns, every turn hashes only its new blocks (and the first).
    #[test]
    fn interleaved_conversations_keep_their_own_history() {
        let memo = PrefixMemo::default();
        let system: Vec<u32> = (0..100 * 16).map(|i| i * 3 + 7).collect();
        let mut conversations: Vec<Vec<u32>> = vec![system.clone(); WAYS];
        let mut rng = fastrand::Rng::with_seed(9);
        for round in 0..10 {
            for conv in conversations.iter_mut() {
                conv.extend((0..16 * 5).map(|_| rng.u32(..50_000)));
                let before = memo.stats();
                assert_eq!(memo.hashes(conv, 16, None), plain(conv, 16, None));
                assert_consistent(&memo);
                let after = memo.stats();
                if round > 0 {
                    assert_eq!(
                        after.blocks_hashed - before.blocks_hashed,
                        1 + 5,
                        "round {round}: only the first block and the 5 new ones hashed"
                    );
                }
            }
        }
    }

    #[test]
    fn common_tokens_reads_pieces_and_runs() {
        let a: Vec<u32> = (0..10_000).collect();
        let mut b = a.clone();
        let n = |x: &[&[u32]], y: &[&[u32]]| common_tokens(x, y, usize::MAX);
        assert_eq!(n(&[&a], &[&b]), 10_000);
        assert_eq!(n(&[&a], &[&b[..1_000]]), 1_000);
        assert_eq!(common_tokens(&[&a], &[&b], 4_321), 4_321);
        // The same tokens cut into other pieces.
        assert_eq!(
            n(
                &[&a[..3], &a[3..5_000], &a[5_000..]],
                &[&b[..4_999], &b[4_999..]]
            ),
            10_000
        );
        b[5_000] = 0;
        assert_eq!(n(&[&a], &[&b]), 5_000);
        assert_eq!(n(&[&a[..7], &a[7..]], &[&b[..2_000], &b[2_000..]]), 5_000);
        b[0] = 1;
        assert_eq!(n(&[&a], &[&b]), 0);
        assert_eq!(n(&[&a], &[]), 0);
        assert_eq!(n(&[&[], &a], &[&a[..0], &a[..10]]), 10);
    }

    /// The memo is used: the second turn of a conversation copies the first turn's hashes (seen
    /// through an entry that holds the second turn afterwards).
    #[test]
    fn a_next_turn_is_remembered_in_place() {
        let memo = PrefixMemo::default();
        let turn1: Vec<u32> = (0..64 * 16).collect();
        let mut turn2 = turn1.clone();
        turn2.extend(5_000..5_000 + 16 * 8);
        memo.hashes(&turn1, 16, None);
        memo.hashes(&turn2, 16, None);
        let held: Vec<usize> = memo
            .sets
            .iter()
            .flat_map(|s| {
                let s = s.lock();
                s.ways.iter().map(|e| e.len).collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(held.iter().sum::<usize>(), turn2.len(), "{held:?}");
        // The second turn copied the first turn's 64 blocks but its first (hashed to find the
        // entry), and hashed its first block and its 8 new ones.
        assert_eq!(
            memo.stats(),
            MemoStats {
                blocks_reused: 63,
                blocks_hashed: 64 + 9
            }
        );
    }
}
