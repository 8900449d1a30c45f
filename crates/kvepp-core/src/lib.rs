//! kvepp's routing core: everything that decides where a request goes, and nothing that moves
//! bytes. No async runtime, no gRPC, HTTP, Kubernetes or ZMQ: callers (the ext_proc server, HTTP
//! services, replica sync, benchmarks) hand it facts and get a decision back.
//!
//! Modules, lowest layer first; each imports only from layers below it:
//! - [`hash`]: the Dynamo-compatible block and sequence hashes (newtypes, one chaining step);
//!   [`types`]: the shared leaf types (worker ranks, overlaps, a prompt as blocks, table hasher).
//! - [`index`]: the prefix index fed by KV events: which worker ranks hold which blocks
//!   ([`index::SharedIndex`]: the copy pair that picks read without waiting for writers);
//!   [`slots`]: the slot tracker: active requests, prefill tokens and decode blocks per rank
//!   (dense ranks, each rank's active blocks a tree, a load version per rank); [`predict`]: the
//!   per-endpoint TTFT model learned online (the `predicted_ttft` cost); [`decode`]: the pool's
//!   inter-token latency model and output lengths learned online (with the TTFT model, the
//!   `predicted_completion` cost); [`listen`]: who hears of
//!   bookings; [`queue`]: flow control's waiting line (priority, then flows in turn, then arrival);
//!   [`affinity`]: the adapters each engine holds and the session bindings.
//! - [`cost`]: the cost model over overlap and load, and the choice among candidates; [`load`]:
//!   per-endpoint in-flight counters.
//! - [`endpoint`]: an endpoint as the core sees it (identity, load, role, domains, pick hints).
//! - [`pick`]: eligibility (subset), saturation and admission, and the [`Picker`]s.
//! - [`kv`]: the KV-aware picker's shared state (index, approximate index, slot tracker) and its
//!   cost over every candidate.
//! - [`booking`]: the decision's guard, [`Booking`], whose drop releases the load and tells the
//!   listeners.
//! - [`disagg`]: prefill/decode roles and the topology-constrained pairing of a disaggregated
//!   pick.
//! - [`router`]: the one transaction: request facts + candidates → decision with its booking.
//! - [`catalog`]: the HTTP services' registered workers by (model, tenant) and their
//!   reservations, each scope deciding through its own [`Router`] (pooled: the ext_proc one).
//!
//! Invariants kept here: a pick only names a candidate; a booking is released exactly once (on
//! drop); a KV-aware booking books the load its pick read or nothing (then the router picks
//! again); randomness and time come from the caller, never from globals or thread-locals.

pub mod affinity;
pub mod booking;
pub mod catalog;
pub mod cost;
pub mod decode;
pub mod disagg;
pub mod endpoint;
pub mod hash;
pub mod index;
pub mod kv;
mod least_loaded;
pub mod listen;
pub mod load;
pub mod pick;
pub mod predict;
pub mod queue;
mod round_robin;
pub mod router;
pub mod slots;
pub mod types;

pub use booking::Booking;
pub use disagg::{MismatchPolicy, Pairing, Role, TransferSettings};
pub use hash::{LocalBlockHash, SequenceHash};
pub use kv::{KvDecision, KvPicker, KvSettings, KvState, PrefixMode, PromptBlocks};
pub use least_loaded::LeastLoaded;
pub use listen::{Admitted, Hub, Listener};
pub use load::{EndpointLoad, EngineMetrics};
pub use pick::{
    is_sheddable, Admission, Criticality, Endpoint, Pick, PickContext, PickError, PickRequest,
    Picker, Ranked, Saturation, Selector, Tuning,
};
pub use queue::{FlowQueue, QueueFull, QueueId};
pub use round_robin::RoundRobin;
pub use router::{Decision, Prompt, RequestFacts, Router};
