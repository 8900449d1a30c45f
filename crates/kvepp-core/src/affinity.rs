//! Affinity: the two things a request may prefer besides a cached prefix and a light load. It owns
//! the LoRA adapters each engine holds ([`adapters`]: what its `vllm:lora_requests_info` says, and
//! what a request for an adapter costs there) and the bindings of client sessions to endpoints
//! ([`sessions`]: bounded, expiring, shared with peer replicas through the router's listeners).
//!
//! Both enter the one transaction in one place each: the adapter term is a per-candidate cost
//! added with the picker's other terms ([`crate::pick::Selector`]), the session binding a filter
//! that keeps a bound request on its endpoint while that endpoint is eligible and not saturated.
//! Invariants: nothing here refuses a request (an unknown adapter or a missing metric is only "no
//! preference"); a binding names a worker rank, never an endpoint object, so it survives
//! discovery updates and means the same on every replica.

pub mod adapters;
pub mod sessions;

pub use adapters::{AdapterAffinity, AdapterFit, AdapterSlots};
pub use sessions::{SessionAffinity, SessionIdError, SessionKey, SessionOutcome, Sessions};
