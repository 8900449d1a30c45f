//! A request's prompt as blocks: how its prefix is found ([`PrefixMode`]) and the block hashes a
//! pick looks up ([`PromptBlocks`]), from token ids (Dynamo's hashes, through the memo of recent
//! prompts) or from raw bytes (approximate mode).
//!
//! Invariants: token blocks are exactly [`crate::hash::local_block_hashes`] and
//! [`crate::hash::sequence_hashes`] of the prompt; approximate blocks are chained xxh3 over
//! fixed-size byte blocks seeded by the model, and never meet token blocks (other seed).

use super::KvState;
use crate::hash::{block_seed, LocalBlockHash, SequenceHash, XXH3_SEED};
pub use crate::types::{PrefixMode, PromptBlocks};

impl KvState {
    /// Blocks of a tokenized prompt (Dynamo's hashes, LoRA-seeded); in approximate-only mode they
    /// are matched against what was routed.
    pub fn blocks_from_tokens(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        mode: PrefixMode,
    ) -> PromptBlocks {
        let hashed = self.memo.hashes(tokens, self.block_size() as usize, lora);
        self.token_blocks(hashed, tokens.len(), mode)
    }

    /// [`Self::blocks_from_tokens`] of tokens the caller is done with: the memo of recent prompts
    /// keeps them instead of a copy.
    pub fn blocks_from_owned_tokens(
        &self,
        tokens: Vec<u32>,
        lora: Option<&str>,
        mode: PrefixMode,
    ) -> PromptBlocks {
        let isl = tokens.len();
        let hashed = self
            .memo
            .hashes_owned(tokens, self.block_size() as usize, lora);
        self.token_blocks(hashed, isl, mode)
    }

    /// [`Self::blocks_from_tokens`] of the tokens of `pieces` one after another (a chat's
    /// segments as the tokenizer's cache holds them): never gathered into one array, and compared
    /// with a recent prompt piece by piece ([`crate::hash::PrefixMemo::hashes_shared`]).
    pub fn blocks_from_pieces(
        &self,
        pieces: Vec<std::sync::Arc<[u32]>>,
        lora: Option<&str>,
        mode: PrefixMode,
    ) -> PromptBlocks {
        let isl = pieces.iter().map(|p| p.len()).sum();
        let hashed = self
            .memo
            .hashes_shared(pieces, self.block_size() as usize, lora);
        self.token_blocks(hashed, isl, mode)
    }

    fn token_blocks(
        &self,
        (locals, hashes): (Vec<LocalBlockHash>, std::sync::Arc<[SequenceHash]>),
        isl: usize,
        mode: PrefixMode,
    ) -> PromptBlocks {
        PromptBlocks {
            mode: if self.settings.approximate_only {
                PrefixMode::Approximate
            } else {
                mode
            },
            locals,
            hashes,
            isl_tokens: isl as u64,
        }
    }

    /// Approximate blocks of a prompt's bytes: chained xxh3 over blocks of
    /// `block_size × approx_bytes_per_token` bytes, seeded by `scope` (the model), through the
    /// memo of recent texts (a text that starts like one of them hashes only what follows).
    pub fn blocks_from_text(&self, scope: &str, text: &[u8]) -> PromptBlocks {
        let per_token = self.settings.approx_bytes_per_token.max(1) as usize;
        let chunk = (self.block_size() as usize) * per_token;
        let seed = block_seed(Some(scope)) ^ XXH3_SEED;
        let (locals, hashes) = self.text_memo.text_hashes(text, chunk, seed);
        PromptBlocks {
            mode: PrefixMode::Approximate,
            hashes,
            locals,
            isl_tokens: (text.len() / per_token) as u64,
        }
    }
}
