#!/usr/bin/env bash
# Local demo on embedded defaults: a simulated fleet of 4 inference engines (prefix caches, a
# time model of an 8B model on an H100, vLLM KV events and metrics), kvepp and a real Envoy 1.40.
# Replays a short shared-prefix workload under each routing policy (round robin, least loaded,
# approximate prefix, precise KV-aware by Dynamo's cost and by predicted TTFT) and prints TTFT,
# latency, throughput, cache hits, load imbalance and TTFT-SLO share per policy. About a minute and
# a half once built; every port is ephemeral on 127.0.0.1.
# Extra flags go to `kvepp-sim bench-routing` (see --help), e.g. --duration 30.
set -euo pipefail
cd "$(dirname "$0")/.."
# Release build: the predicted-TTFT policy learns from the TTFTs it observes, and a debug build's
# own overhead distorts them (its p90 TTFT came out at 1.8 s and 8.8 s in debug runs, 0.23 s in
# release, on this 2-core VM).
echo "== building kvepp-sim in release mode (kvepp runs inside it) and installing Envoy (the first run compiles for several minutes)" >&2
cargo build --locked --release --quiet -p kvepp-bench
envoy=$(scripts/install-envoy.sh)
exec target/release/kvepp-sim bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml --workload shared-prefix --duration 12 \
  --out target/demo "$@"
