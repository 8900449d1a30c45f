#!/usr/bin/env bash
# The routing-quality report behind docs/performance.md's "Routing quality" section: one `bench-routing`
# invocation runs every policy (round robin, least loaded, approximate prefix, precise KV with
# Dynamo's cost, the default configuration, and the clairvoyant reference placement) on every
# workload (shared prefix, the Mooncake
# trace's first 300 requests at 1× speed, multi-turn conversations with one and with two kvepp
# replicas, the conversations mixed with a second client's direct traffic, and with an engine
# restart halfway) on 4 simulated engines, the Mooncake trace on 8 (four engines' caches cannot
# hold the reuse it comes back to a minute later), with kvepp configured by bench/kvepp.yaml. Release
# build; results in bench/results/routing/ (results.md, results.json, requests.csv, routing.png). About 40
# minutes on 2 cores. PREBUILT=1 uses target/release as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${PREBUILT:-}" ] || cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
# The caller's own --out wins (clap takes each flag once).
out=(--out bench/results/routing)
for a in "$@"; do
  case "$a" in --out|--out=*) out=() ;; esac
done
target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml \
  --engines 4 --trace-engines 8 --duration 30 --trace-requests 300 --speed 1 "${out[@]}" "$@"
