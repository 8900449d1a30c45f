//! The ext_proc protocol as kvepp speaks it, below any routing: what Envoy's `Process` stream
//! carries and how kvepp's answers are framed on it.
//!
//! - [`wire`]: the request and response envelopes and the body-carrying messages, as prost types
//!   whose bodies are `bytes::Bytes` (a body is sliced from the gRPC buffer, never copied),
//!   field for field Envoy's `external_processor.proto` (checked against `envoy-types`);
//! - [`framing`]: the response stream's gRPC framing, which sends a body chunk going back to
//!   Envoy from where it lies.
//!
//! What an answer says (routing headers, immediate responses) is the server's; this crate knows
//! only the messages and their bytes.

pub mod framing;
pub mod wire;
