//! From a request body to the routing core's facts, and the routing service the front doors call
//! ([`service`]): the model name, its InferenceModel (criticality, weighted target models), the
//! InferenceObjective named by header (priority), when a
//! target model differs the byte-level rewrite of `model`, and the prompt (token ids, tokenized
//! text, or raw bytes for approximate blocks).
//!
//! Invariants: the body is parsed in place (no copy, no re-serialisation); a rewrite replaces
//! exactly the bytes of the `model` value and nothing else; hashing, picking and booking are the
//! core's (`kvepp_core::Router`), never done here.

pub(crate) mod affinity;
mod formats;
mod model;
mod prompt;
pub(crate) mod service;

pub use affinity::Affinity;
pub use model::{resolve_model, ModelDecision, ModelError, UNLISTED_MODEL_LABEL};
pub use prompt::{prompt_for_routing, prompt_input, PromptInput};
pub use service::{
    Objective, Prepared, Rejection, RequestHead, RequestRouter, RouteHints, RouteRequest, Routed,
    Verdict,
};
