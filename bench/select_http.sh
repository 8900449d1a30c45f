#!/usr/bin/env bash
# The selection service's HTTP overhead: /select_and_reserve + DELETE /reservations/{id} pairs per
# second over HTTP/1.1 keep-alive (1 and 4 connections) against the same pick + free called
# in-process on the same catalog, 100 workers, 32k-token prompts. Release build; prints a markdown
# table with the ratio. Extra arguments go to `kvepp-bench bench-select`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
target/release/kvepp-bench bench-select --workers 100 --tokens 32768 "$@"
