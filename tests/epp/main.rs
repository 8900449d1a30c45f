//! kvepp from outside, one process at a time: its gRPC protocol driven directly, requests through
//! a real Envoy to real HTTP backends, the binary as a user runs it, its security, flow control,
//! engine metrics, configuration reloads, faults under load, the shipped manifests and what the
//! repository packages. One test binary: each module is one of these concerns.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod binary;
mod engine_metrics;
mod envoy_e2e;
mod extproc_grpc;
mod faults;
mod flow_control;
mod manifests;
mod operations;
mod packaging;
mod security;
