#!/usr/bin/env bash
# EPP CPU per request at ~100k-token prompts through a real Envoy, in each prefix mode
# (approximate text, token ids, tokenized chat), with the floor EPP (fixed endpoint, never reads
# the body) on the same bodies in the same run. Process CPU time (utime + stime) per request under
# wrk load. Usage: bench/cpu_per_request.sh [--duration S] [--concurrency N] [--repeat R]
set -euo pipefail
cd "$(dirname "$0")/.."
envoy=$(scripts/install-envoy.sh)
if ! command -v wrk >/dev/null; then
  echo "bench: installing wrk (Debian package)" >&2
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q wrk >&2 || { apt-get update -q >&2 && apt-get install -y -q wrk >&2; }
  else sudo apt-get install -y -q wrk >&2; fi
fi
.venv/bin/python -c "import yaml" 2>/dev/null || .venv/bin/pip install --quiet --disable-pip-version-check pyyaml >&2
cargo build --locked --release --quiet --bin kvepp --example floor_epp --example tokenize_cost
exec .venv/bin/python bench/cpu_per_request.py --envoy "$envoy" "$@"
