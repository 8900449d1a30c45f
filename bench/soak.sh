#!/usr/bin/env bash
# Soak: the full stack (a simulated fleet of vLLM-like engines, the release kvepp, a real Envoy)
# under a fixed open-loop request rate for a configurable time. kvepp's RSS, open file descriptors,
# threads and runtime tasks are sampled every second with the requests/s, errors and p99 latency;
# written to bench/results/soak/soak.csv and soak.png with summary.json. Exits 1 on any failed
# request. kvepp runs with bench/soak.yaml, the engines with 4096 KV blocks each (see there).
# Usage: bench/soak.sh [--minutes M (10)]
# [--rate R req/s (100)] [--engines N (4)] [--kv-blocks B (4096)] [--kvepp-config FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
envoy=$(scripts/install-envoy.sh)
.venv/bin/python -c "import yaml, matplotlib" 2>/dev/null ||
  .venv/bin/pip install --quiet --disable-pip-version-check pyyaml matplotlib >&2
cargo build --locked --release --quiet -p kvepp --bin kvepp
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
exec .venv/bin/python bench/soak.py --envoy "$envoy" "$@"
