#!/usr/bin/env bash
# The routing-quality benchmark behind the README's tables and charts: the synthetic shared-prefix
# workload (4 engines with 64k-token caches, 24 req/s for 30 s) and the first 600 requests of the
# Mooncake conversation trace at 4× speed (8 engines, H100 defaults), each under the four policies,
# with kvepp configured by bench/kvepp.yaml. Release build; results in bench/results/<workload>/
# (results.md, results.json, routing.png). About 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
sim=target/release/kvepp-sim
"$sim" bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml --workload shared-prefix \
  --engines 4 --duration 30 --out bench/results/shared-prefix
"$sim" bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml --workload mooncake \
  --engines 8 --trace-requests 600 --speed 4 --out bench/results/mooncake
