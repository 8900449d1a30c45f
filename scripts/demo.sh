#!/usr/bin/env bash
# Local demo on embedded defaults: a simulated fleet of 4 inference engines (prefix caches, a
# time model of an 8B model on an H100, vLLM KV events and metrics), kvepp and a real Envoy 1.40.
# Replays a short shared-prefix workload under each routing policy (round robin, least loaded,
# approximate prefix, precise KV-aware by Dynamo's cost and by predicted TTFT) and prints TTFT,
# latency, throughput, cache hits, load imbalance and TTFT-SLO share per policy. A few minutes once
# built; every port is ephemeral on 127.0.0.1.
# Extra flags go to `kvepp-sim bench-routing` (see --help), e.g. --duration 30.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== building kvepp-sim (kvepp runs inside it) and installing Envoy (first run takes a few minutes)" >&2
cargo build --locked --quiet -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
exec target/debug/kvepp-sim bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml --workload shared-prefix --duration 12 \
  --out target/demo "$@"
