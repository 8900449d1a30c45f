//! kvepp: an Endpoint Picker (EPP) for LLM inference behind Envoy.
//!
//! A request flows through the modules in this order:
//!
//! 1. [`extproc`]: the Envoy ext_proc gRPC protocol (headers, body chunks, responses).
//! 2. [`request`]: the body becomes a model name (and later tokens and block hashes).
//! 3. [`selector`]: eligible endpoints, saturation/shedding and the pick itself. Plain library, no
//!    gRPC or HTTP types, so every front end calls the same code.
//!
//! Beside them: [`discovery`] keeps the pool's endpoints and models up to date, [`kv_events`] decodes
//! the engines' KV-cache events, [`engine`] scrapes the load signals engines publish, [`config`] is the
//! single typed configuration, [`api`] serves the HTTP endpoints (metrics, health), [`metrics`]
//! holds the Prometheus registry and [`server`] wires everything together.

pub mod agent;
pub mod api;
pub mod config;
pub mod discovery;
pub mod engine;
pub mod extproc;
pub mod kv_events;
pub mod metrics;
pub mod pace;
pub mod process;
pub mod request;
pub mod server;
pub mod upkeep;
