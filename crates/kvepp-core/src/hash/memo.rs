//! The block hashes of recent token prompts, so that a prompt which starts like one of them (a
//! conversation's next turn carries the whole previous turn; many requests share a long system
//! prompt) hashes only its blocks after the common part. On a 100k-token prompt that turns ~6,000
//! xxh3 calls into one comparison of the two token arrays (memcmp speed) and the new blocks.
//!
//! Prompts are spread over a few sets by their first block's local hash; a set keeps the last
//! few prompts seen there (tokens, local and sequence hashes). A prompt reads from the one that
//! is a prefix of it (its previous turn: the last block checked first, then every token), else
//! from the set's most recently used one (a shared document or system prompt), and is remembered
//! in place of the one it extends, else in place of the least recently used. So a long shared
//! start is reused by every prompt that has it, and up to `WAYS` conversations interleaving behind
//! one system prompt each reuse their own history.
//!
//! Invariants: [`PrefixMemo::hashes`] returns exactly what [`super::local_block_hashes`] and
//! [`super::sequence_hashes`] return for the same input (a differential test checks it); an
//! entry's hashes are reused only for blocks whose tokens, seed and block size equal the prompt's
//! (compared token for token, not by hash); an entry another pick is using is skipped, never
//! waited for; memory is bounded by `SETS × WAYS × MAX_TOKENS` tokens and their hashes.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{block_seed, extend_block_hashes, LocalBlockHash, SequenceHash};

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
    /// The full blocks of the prompt remembered here.
    tokens: Vec<u32>,
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

    /// Whether it may be a prefix of `full`: it fits and its last block equals `full`'s block at
    /// the same position (the token-for-token comparison decides).
    fn may_lead(&self, full: &[u32], seed: u64, block_size: usize) -> bool {
        let n = self.tokens.len();
        self.fits(seed, block_size)
            && n >= block_size
            && n <= full.len()
            && self.tokens[n - block_size..] == full[n - block_size..n]
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
}

impl Tokens<'_> {
    fn as_slice(&self) -> &[u32] {
        match self {
            Tokens::Borrowed(t) => t,
            Tokens::Owned(t) => t,
        }
    }
}

/// Whole blocks that `a` and `b` share from their start.
fn common_blocks(a: &[u32], b: &[u32], block_size: usize) -> usize {
    let end = a.len().min(b.len()) / block_size * block_size;
    // Long runs first (one memcmp each), then block by block inside the run that differs.
    let run = 64 * block_size;
    let mut i = 0;
    while i + run <= end && a[i..i + run] == b[i..i + run] {
        i += run;
    }
    while i + block_size <= end && a[i..i + block_size] == b[i..i + block_size] {
        i += block_size;
    }
    i / block_size
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
    ) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
        self.count(self.hashes_counting_reuse(Tokens::Borrowed(tokens), block_size, lora))
    }

    /// [`Self::hashes`] of tokens the caller has no further use for: they are remembered as they
    /// are, not copied (on a 100k-token prompt that saves writing 400 KB per request).
    pub fn hashes_owned(
        &self,
        tokens: Vec<u32>,
        block_size: usize,
        lora: Option<&str>,
    ) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
        self.count(self.hashes_counting_reuse(Tokens::Owned(tokens), block_size, lora))
    }

    fn count(
        &self,
        (locals, hashes, reused): (Vec<LocalBlockHash>, Vec<SequenceHash>, usize),
    ) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
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
    ) -> (Vec<LocalBlockHash>, Vec<SequenceHash>, usize) {
        let (mut locals, mut hashes) = (Vec::new(), Vec::new());
        if block_size == 0 {
            return (locals, hashes, 0);
        }
        let tokens = input.as_slice();
        let blocks = tokens.len() / block_size;
        let full = &tokens[..blocks * block_size];
        let seed = block_seed(lora);
        locals.reserve_exact(blocks);
        hashes.reserve_exact(blocks);
        // Hashes the blocks after those already in `locals`.
        let hash_rest = |locals: &mut Vec<LocalBlockHash>, hashes: &mut Vec<SequenceHash>| {
            extend_block_hashes(
                &full[locals.len() * block_size..],
                block_size,
                seed,
                locals,
                hashes,
            )
        };
        if blocks < MIN_BLOCKS {
            hash_rest(&mut locals, &mut hashes);
            return (locals, hashes, 0);
        }
        // The first block picks the entry (its hash is needed anyway).
        extend_block_hashes(
            &full[..block_size],
            block_size,
            seed,
            &mut locals,
            &mut hashes,
        );
        let at = (locals[0].0 >> 32) as usize % self.sets.len();
        let Some(mut set) = self.sets.get(at).and_then(|e| e.try_lock()) else {
            // Another pick is on this set (or it was poisoned): hash without it.
            hash_rest(&mut locals, &mut hashes);
            return (locals, hashes, 0);
        };
        let set = &mut *set;
        set.clock += 1;
        let ways = &mut set.ways;
        // Read from the longest prompt that may lead this one, else the most recently used.
        let read = (0..WAYS)
            .filter(|&w| ways[w].may_lead(full, seed, block_size))
            .max_by_key(|&w| ways[w].tokens.len())
            .or_else(|| {
                (0..WAYS)
                    .filter(|&w| ways[w].fits(seed, block_size))
                    .max_by_key(|&w| ways[w].used)
            });
        let reuse = read.map_or(0, |w| common_blocks(&ways[w].tokens, full, block_size));
        if let (Some(w), true) = (read, reuse > 1) {
            locals.extend_from_slice(&ways[w].locals[1..reuse]);
            hashes.extend_from_slice(&ways[w].hashes[1..reuse]);
            ways[w].used = set.clock;
        }
        let copied = locals.len() - 1;
        hash_rest(&mut locals, &mut hashes);
        if full.len() <= MAX_TOKENS {
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
            let full_len = full.len();
            match input {
                // Nothing to copy: the prompt's own tokens, cut to its full blocks (in place).
                Tokens::Owned(mut own) => {
                    own.truncate(full_len);
                    own.shrink_to_fit();
                    e.tokens = own;
                }
                Tokens::Borrowed(_) => {
                    e.tokens.truncate(keep * block_size);
                    e.tokens.extend_from_slice(&full[keep * block_size..]);
                }
            }
            e.locals.truncate(keep);
            e.locals.extend_from_slice(&locals[keep..]);
            e.hashes.truncate(keep);
            e.hashes.extend_from_slice(&hashes[keep..]);
            e.used = set.clock;
        }
        (locals, hashes, copied)
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
    ) -> (Vec<LocalBlockHash>, Vec<SequenceHash>) {
        let l = local_block_hashes(tokens, bs, lora);
        let s = sequence_hashes(&l);
        (l, s)
    }

    /// Every remembered prompt's hashes are those of its own tokens (what makes reusing them
    /// exact).
    fn assert_consistent(memo: &PrefixMemo) {
        for set in memo.sets.iter() {
            let set = set.lock();
            for e in set.ways.iter().filter(|e| e.used > 0) {
                assert_eq!(
                    e.tokens.len(),
                    e.locals.len() * e.block_size,
                    "full blocks only"
                );
                let lora_free = e.seed == block_seed(None);
                let (l, h) = if lora_free {
                    plain(&e.tokens, e.block_size, None)
                } else {
                    plain(&e.tokens, e.block_size, Some("adapter"))
                };
                assert_eq!(
                    (&e.locals, &e.hashes),
                    (&l, &h),
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
        let mut conversations: Vec<Vec<u32>> = (0..60)
            .map(|i| systems[i % systems.len()].clone())
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
                }
                1 => conv.truncate(rng.usize(..conv.len() + 1)),
                _ => {
                    let n = rng.usize(1..300);
                    conv.extend((0..n).map(|_| rng.u32(..50_000)));
                }
            }
            let bs = if step % 50 == 49 { 8 } else { 16 };
            let lora = [None, None, None, Some("adapter")][rng.usize(..4)];
            let want = plain(conv, bs, lora);
            // Lent or handed over (the memo then keeps that very vector): the same hashes.
            let got = if rng.bool() {
                memo.hashes(conv, bs, lora)
            } else {
                memo.hashes_owned(conv.clone(), bs, lora)
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
        assert_eq!(memo.hashes(&long, 0, None), (vec![], vec![]));
        let (owned, zero) = (memo.hashes_owned(long.clone(), 16, None), long.clone());
        assert_eq!(owned, plain(&long, 16, None));
        assert_eq!(memo.hashes_owned(zero, 0, None), (vec![], vec![]));
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
    fn common_blocks_counts_whole_equal_blocks_from_the_start() {
        let a: Vec<u32> = (0..10_000).collect();
        let mut b = a.clone();
        assert_eq!(common_blocks(&a, &b, 16), 625);
        assert_eq!(common_blocks(&a, &b[..1_000], 16), 62);
        b[5_000] = 0;
        assert_eq!(common_blocks(&a, &b, 16), 312);
        b[0] = 1;
        assert_eq!(common_blocks(&a, &b, 16), 0);
        assert_eq!(common_blocks(&a, &[], 16), 0);
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
                s.ways.iter().map(|e| e.tokens.len()).collect::<Vec<_>>()
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
