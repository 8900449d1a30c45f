#!/usr/bin/env bash
# Rolling upgrade under load: two `kvepp serve` processes (release build) behind one Envoy with the
# shipped bootstrap (fail-close, health-checked ext_proc cluster), a simulated fleet of 4 engines
# publishing KV events, 8 req/s of shared-prefix requests; after 20 s of warm-up and a 60 s window,
# each replica is restarted by SIGTERM one after the other, twice, then a second 60 s window.
# Prints requests sent and failed, the longest stall (TTFT max) during the rollout, and the prefix
# hit ratio before and after; the table goes to bench/results/rollout/rollout.md.
# Extra arguments go to `kvepp-bench bench-rollout` (e.g. --rate 16 --window-seconds 30).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet --bin kvepp -p kvepp
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
target/release/kvepp-bench bench-rollout --envoy "$envoy" --kvepp target/release/kvepp \
  --out bench/results/rollout "$@"
