#!/usr/bin/env bash
# EPP CPU per request at ~100k-token prompts through a real Envoy, in each prefix mode
# (approximate text, token ids, tokenized chat on the fixture tokenizer and on DeepSeek's 128k
# one), with the floor EPP (fixed endpoint, never reads the body) on the same bodies in the same
# run. Process CPU time (utime + stime) per request under wrk load.
# Usage: bench/cpu_per_request.sh [--duration S] [--concurrency N] [--repeat R] [--modes M,...]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/prereqs.sh
cargo build --locked --release --quiet --bin kvepp --example floor_epp --example tokenize_cost
exec .venv/bin/python bench/cpu_per_request.py --envoy "$envoy" "$@"
