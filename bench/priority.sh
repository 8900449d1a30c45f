#!/usr/bin/env bash
# Flow control under a burst: a simulated fleet (engines limited to --max-num-seqs running
# requests, kvepp's saturation limit the same), the release kvepp and a real Envoy (bootstrap from
# `kvepp envoy-config`), and a burst of streamed requests faster than the fleet serves them: a
# quarter `interactive` (InferenceObjective priority 10), the rest `batch` (priority -1,
# sheddable). Run once with flow control and once with immediate shedding; prints and writes
# bench/results/priority/results.{md,json}: TTFT p50/p99 per objective and the share served.
# Usage: bench/priority.sh [--requests N (600)] [--rate R (150)] [--high-share F (0.25)]
#   [--engines E (2)] [--max-num-seqs S (8)] [--max-tokens T (64)]
set -euo pipefail
cd "$(dirname "$0")/.."
envoy=$(scripts/install-envoy.sh)
.venv/bin/python -c "import yaml" 2>/dev/null ||
  .venv/bin/pip install --quiet --disable-pip-version-check pyyaml >&2
cargo build --locked --release --quiet -p kvepp --bin kvepp
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
exec .venv/bin/python bench/priority.py --envoy "$envoy" "$@"
