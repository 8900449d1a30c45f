#!/usr/bin/env bash
# Adapter and session affinity (docs/performance.md, "Adapter and session affinity"): one `bench-adapters` run on
# 8 simulated engines with 4 LoRA adapter slots each (100 ms per adapter load, least recently used
# idle adapter evicted), through a real Envoy and kvepp:
# - 32 adapters of Zipf(1.1) popularity, 30 requests/s for 20 s, unique prompts, under least loaded,
#   KV-aware picking blind to adapters and KV-aware picking with adapter affinity (the default):
#   p50/p90 TTFT, adapter loads per second, evictions;
# - multi-turn conversations with a session id each, through one and two kvepp replicas, session
#   affinity on (the default) and off: the share of turns on the previous turn's engine.
# Release build (a no-op on a tree with prebuilt release binaries); results in
# bench/results/adapters/adapters.md. About 5 minutes on 2 cores. Extra flags go to bench-adapters.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
target/release/kvepp-bench bench-adapters --envoy "$envoy" --out bench/results/adapters "$@"
