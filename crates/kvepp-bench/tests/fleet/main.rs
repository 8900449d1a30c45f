//! The simulated fleet in front of kvepp and a real Envoy: kvepp's KV-event index against the
//! engines' caches, routing over replays of the benchmark's workloads, LoRA adapters, data-parallel
//! ranks, prefill/decode disaggregation and rolling upgrades. One test binary: each module is one
//! of these concerns, `common` their helpers.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod adapter;
mod common;
mod data_parallel;
mod disagg;
mod rollout;
mod routing;
