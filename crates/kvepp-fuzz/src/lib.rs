//! kvepp's fuzz targets, for cargo-fuzz (`fuzz_targets/`) and for the corpus replay in the test
//! command (`tests/fuzz_corpus.rs` includes [`targets`] by path).

pub mod targets;
