//! kvepp: an Endpoint Picker (EPP) for LLM inference behind Envoy.
//!
//! A request flows through the modules in this order, and nothing imports upward:
//!
//! 1. [`extproc`]: the Envoy ext_proc protocol (headers, body chunks, responses), a sans-IO state
//!    machine per stream; it asks the routing service for a decision and renders it.
//! 2. [`routing`]: the routing service: the body becomes facts (model, InferenceModel, criticality,
//!    prompt tokens or bytes) in place, without copies or re-serialisation; [`admission`] (flow
//!    control and rate limits) holds or refuses the request on those facts.
//! 3. `kvepp_core` (the `kvepp-core` crate): `Router::route` hashes the prompt, picks among the
//!    pool's ready endpoints and books the pick; no runtime, gRPC, HTTP or Kubernetes in it.
//! 4. back in [`extproc`]: the destination header and metadata, the body as it was (or with the
//!    model rewritten), and on the response side the booking released exactly once.
//!
//! Beside them: [`discovery`] keeps the pool's endpoints and models (and publishes a watch of the
//! ready endpoints), [`engine`] is the engines' HTTP surface (`/metadata`, `/metrics`),
//! [`kv_events`] feeds the engines' KV-cache events into the core's index, [`upkeep`] forgets
//! departed endpoints and expires lost bookings, [`config`] is the one configuration tree (each
//! component declares its settings), [`api`] serves the HTTP endpoints (metrics, health, debug),
//! [`metrics`] holds the Prometheus registry, [`replica`] shares request lifecycle events between
//! kvepp processes over ZMQ, [`agent`] is the worker-agent sidecar, [`process`] the binaries'
//! logging and signals, [`pace`] the periodic scrape's timer, and [`server`] (`kvepp serve`) and
//! [`standalone`] (`kvepp select-service`, `kvepp slot-tracker`) wire everything together. The test-only module `reference` sits above them all: it generates
//! `docs/configuration.md` from the configuration types and every binary's flags (nothing of it
//! ships in a binary).

pub mod admission;
pub mod agent;
pub mod api;
pub mod config;
pub mod discovery;
pub mod engine;
pub mod envoy_config;
pub mod extproc;
pub mod kv_events;
pub mod metrics;
pub(crate) mod pace;
pub mod process;
#[cfg(test)]
mod reference;
pub mod replica;
pub mod routing;
pub mod server;
pub mod standalone;
pub mod telemetry;
pub(crate) mod upkeep;
