//! From a request body to what the selector needs: the model name, its InferenceModel (criticality,
//! weighted target models), when a target model differs the byte-level rewrite of `model`, and the
//! Dynamo-compatible block hashes of a token sequence ([`blocks`]).
//!
//! Invariants: the body is parsed in place (no copy, no re-serialisation); a rewrite replaces
//! exactly the bytes of the `model` value and nothing else.

pub mod blocks;
mod body;
mod model;
mod prompt;
pub mod tokenize;

pub use body::{parse_body, BodyError, ParsedBody, Rewrite};
pub use model::{resolve_model, ModelDecision, ModelError, UNLISTED_MODEL_LABEL};
pub use prompt::{prompt_blocks, prompt_input, PromptInput};
