#!/usr/bin/env bash
# The routing benchmark's shared-prefix run (4 engines, 24 req/s for 30 s) with two kvepp replicas
# behind one Envoy (its ext_proc cluster spreads streams over both), replica sync on and off, for the
# two KV-aware policies. Release build; results in bench/results/replicas-sync-{on,off}/.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
for sync in true false; do
  out=bench/results/replicas-sync-$([ "$sync" = true ] && echo on || echo off)
  target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml \
    --workload shared-prefix --engines 4 --duration 30 --replicas 2 --replica-sync "$sync" \
    --policy approximate-prefix --policy precise-kv --out "$out"
done
