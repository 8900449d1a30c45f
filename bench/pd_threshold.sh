#!/usr/bin/env bash
# Disaggregating only what is not cached: the disaggregated fleet of bench/disaggregation.sh
# (4 prefill, 4 decode engines, two zones, shared-prefix workload), the default configuration with
# `disaggregation.prefill_threshold_tokens` 0 (every prompt through a prefill worker, as when the
# prompt's length decided) and 1024 (a request whose uncached part on the best decode worker is at
# most 1024 tokens is prefilled there). Release build; results in
# bench/results/disaggregation-threshold/t{0,1024}/. About 3 minutes on 2 cores.
# PREBUILT=1 uses target/release as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${PREBUILT:-}" ] || cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
config=$(mktemp --suffix=.yaml)
trap 'rm -f "$config"' EXIT
for t in 0 1024; do
  printf 'log_level: warn\ndisaggregation:\n  prefill_threshold_tokens: %s\n' "$t" >"$config"
  target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config "$config" \
    --workload shared-prefix --engines 8 --prefill-engines 4 --zones a,b --policy default \
    --topology off --duration "${DURATION:-20}" --rate "${RATE:-12}" --groups 24 \
    --out "bench/results/disaggregation-threshold/t$t" "$@" >&2
  tail -n 2 "bench/results/disaggregation-threshold/t$t/results.md"
done
