#!/usr/bin/env bash
# The ext_proc hop benchmark: the same Envoy and backend at fixed concurrency, three ways in one
# run (no ext_proc, the minimal fixed-endpoint ext_proc "floor", kvepp), for 4 KiB and 400 KiB
# bodies. Prints requests/s, p50/p99 latency, EPP CPU per request and the kvepp/floor ratios.
# Usage: bench/extproc_overhead.sh [--duration S] [--concurrency N] [--repeat R] [--mode MODE]
#        [--envoy-workers W]   (Envoy worker threads and wrk threads; e.g. --envoy-workers 4 --concurrency 64
#                               where the machine has the cores)
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/prereqs.sh
cargo build --locked --release --quiet --bin kvepp --example floor_epp
exec .venv/bin/python bench/extproc_overhead.py --envoy "$envoy" "$@"
