//! What kvepp reads of a prompt and of the engines' caches: KV-event payloads byte for byte and
//! over real ZMQ, tokenization against the engine stack's (fixture and DeepSeek's tokenizers), and
//! KV-aware routing end to end through a real Envoy in front of simulated engines. One test binary:
//! each module is one of these concerns.
// Test code: a failed expectation is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod kv_events_fixtures;
mod kv_events_zmq;
mod kv_routing;
mod tokenizer_deepseek;
mod tokenizer_fixtures;
