//! Dynamo-compatible KV block hashes of a token sequence.
//!
//! - Tokens are cut into full blocks of `block_size`; a partial trailing block is not hashed.
//! - A block's local hash is `xxh3_64_with_seed(little-endian u32 bytes of its tokens, seed)`, where
//!   the seed is 1337, or `1337 + xxh3_64(lora_name)` (wrapping) for a non-empty LoRA adapter name.
//! - Sequence hashes chain with the fixed seed 1337 (the LoRA seed only enters through the local
//!   hashes): `seq[0] = local[0]`, `seq[i] = xxh3_64_with_seed(le_u64(seq[i-1]) ‖ le_u64(local[i]), 1337)`.
//!
//! Hashes are `u64` here; in JSON they travel as the `i64` with the same bits (`as_i64`/`from_i64`).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

mod memo;
pub use memo::{common_prefix, MemoStats, PrefixMemo};

/// Dynamo's XXH3 seed.
pub const XXH3_SEED: u64 = 1337;

/// Hash of one block's tokens alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalBlockHash(pub u64);

/// Hash of a block together with every block before it (identifies a prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SequenceHash(pub u64);

macro_rules! json_i64 {
    ($t:ty) => {
        impl $t {
            /// The same 64 bits as a signed integer (how hashes travel in JSON).
            pub fn as_i64(self) -> i64 {
                self.0 as i64
            }
            pub fn from_i64(v: i64) -> Self {
                Self(v as u64)
            }
        }
    };
}
json_i64!(LocalBlockHash);
json_i64!(SequenceHash);

/// The seed of the local block hashes for an optional LoRA adapter (an empty name is no adapter).
pub fn block_seed(lora_name: Option<&str>) -> u64 {
    match lora_name.filter(|n| !n.is_empty()) {
        Some(name) => XXH3_SEED.wrapping_add(xxh3_64(name.as_bytes())),
        None => XXH3_SEED,
    }
}

/// Local hashes of the full blocks of `tokens`. A `block_size` of 0 hashes nothing.
pub fn local_block_hashes(
    tokens: &[u32],
    block_size: usize,
    lora_name: Option<&str>,
) -> Vec<LocalBlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    push_local_hashes(tokens, block_size, block_seed(lora_name), &mut out);
    out
}

/// Appends the local hashes of the full blocks of `tokens` (`block_size` > 0) under `seed`.
fn push_local_hashes(tokens: &[u32], block_size: usize, seed: u64, out: &mut Vec<LocalBlockHash>) {
    // One buffer of the block's little-endian bytes, overwritten in place (a plain loop over
    // fixed 4-byte chunks, which the compiler vectorises).
    let mut bytes = vec![0u8; block_size * 4];
    out.extend(tokens.chunks_exact(block_size).map(|block| {
        for (dst, t) in bytes.chunks_exact_mut(4).zip(block) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        LocalBlockHash(xxh3_64_with_seed(&bytes, seed))
    }));
}

impl SequenceHash {
    /// The one chaining step: the sequence hash of the block `local` after `parent` (`None`: the
    /// block starts a sequence, and its sequence hash is its local hash).
    pub fn chain(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
        match parent {
            None => SequenceHash(local.0),
            Some(p) => next_sequence_hash(p, local),
        }
    }
}

/// The sequence hash of a block whose parent has sequence hash `parent`.
pub fn next_sequence_hash(parent: SequenceHash, local: LocalBlockHash) -> SequenceHash {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
    bytes[8..].copy_from_slice(&local.0.to_le_bytes());
    SequenceHash(xxh3_64_with_seed(&bytes, XXH3_SEED))
}

/// The sequence hashes of `locals`, of which the first `known.len()` are `known` (taken from a
/// remembered prompt rather than chained again), written straight into the shared list.
pub(crate) fn chained(
    locals: &[LocalBlockHash],
    known: &[SequenceHash],
) -> std::sync::Arc<[SequenceHash]> {
    let known = &known[..known.len().min(locals.len())];
    let mut parent = known.last().copied();
    // The known part copied as a run, the rest chained on from its last hash.
    known
        .iter()
        .copied()
        .chain(locals[known.len()..].iter().map(|&local| {
            let h = SequenceHash::chain(parent, local);
            parent = Some(h);
            h
        }))
        .collect()
}

/// Chains local hashes into sequence hashes, starting a new sequence (`seq[0] = local[0]`).
pub fn sequence_hashes(locals: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out: Vec<SequenceHash> = Vec::with_capacity(locals.len());
    for &local in locals {
        out.push(SequenceHash::chain(out.last().copied(), local));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Golden vectors computed with an independent implementation (Python `xxhash` 3.x, `struct.pack`
    // of little-endian u32 tokens and u64 chain inputs) from the definition in the module doc.
    fn check(tokens: &[u32], block_size: usize, lora: Option<&str>, local: &[u64], seq: &[u64]) {
        let l = local_block_hashes(tokens, block_size, lora);
        assert_eq!(
            l.iter().map(|h| h.0).collect::<Vec<_>>(),
            local,
            "local, lora {lora:?}"
        );
        let s = sequence_hashes(&l);
        assert_eq!(
            s.iter().map(|h| h.0).collect::<Vec<_>>(),
            seq,
            "sequence, lora {lora:?}"
        );
    }

    #[test]
    fn golden_vectors() {
        let t: Vec<u32> = (1..=16).collect();
        check(
            &t,
            4,
            None,
            &[
                0xcb38e4d7fb2dca5c,
                0xe8d3ec39b907b74c,
                0x06b748f1777d599c,
                0x01e03482f18b34e9,
            ],
            &[
                0xcb38e4d7fb2dca5c,
                0x44a2b2379d6d3c3d,
                0xaea1e67a6c80cf84,
                0x1aaa5eb6e2524a3b,
            ],
        );
        check(
            &t,
            4,
            Some("alpha-7b"),
            &[
                0xe5a7d44a033f7455,
                0xc374ae2d620a90c3,
                0x275c0b2a9cb3dc05,
                0x0842814290fe0064,
            ],
            &[
                0xe5a7d44a033f7455,
                0x088f1052eeb87f7f,
                0x2a007d514ca41ab0,
                0xb3942566a1995111,
            ],
        );
        // The partial trailing block (tokens 8, 9) is not hashed.
        let t: Vec<u32> = (0..10).collect();
        check(
            &t,
            4,
            None,
            &[0x7ee2cbedc694ab46, 0xa8416cfd935bdb13],
            &[0x7ee2cbedc694ab46, 0x83fb702f20e2ad65],
        );
        // Tokens are u32: the high bit and the maximum survive the encoding.
        check(
            &[u32::MAX, 0, 1 << 31, 7],
            2,
            None,
            &[0x281d4ec618d46521, 0x355680dee296326b],
            &[0x281d4ec618d46521, 0x4731d1f652cddc5e],
        );
    }

    #[test]
    fn empty_lora_is_no_lora_and_zero_block_size_hashes_nothing() {
        let t: Vec<u32> = (1..=8).collect();
        assert_eq!(
            local_block_hashes(&t, 4, Some("")),
            local_block_hashes(&t, 4, None)
        );
        assert!(local_block_hashes(&t, 0, None).is_empty());
        assert!(local_block_hashes(&t[..3], 4, None).is_empty());
        assert!(sequence_hashes(&[]).is_empty());
    }

    #[test]
    fn shared_prefix_shares_sequence_hashes_only_up_to_the_first_difference() {
        let a: Vec<u32> = (0..32).collect();
        let mut b = a.clone();
        b[20] = 999; // block 5 of size 4
        let sa = sequence_hashes(&local_block_hashes(&a, 4, None));
        let sb = sequence_hashes(&local_block_hashes(&b, 4, None));
        assert_eq!(sa[..5], sb[..5]);
        assert!(
            sa[5..].iter().zip(&sb[5..]).all(|(x, y)| x != y),
            "a changed block changes every later prefix"
        );
    }

    #[test]
    fn json_i64_is_bit_for_bit() {
        let h = SequenceHash(0xcb38e4d7fb2dca5c);
        assert!(h.as_i64() < 0);
        assert_eq!(SequenceHash::from_i64(h.as_i64()), h);
        assert_eq!(LocalBlockHash::from_i64(-1).0, u64::MAX);
    }
}
