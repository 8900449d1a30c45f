#!/usr/bin/env bash
# Routing on traces it was never tuned on: for each reuse structure (shared system prompts,
# multi-turn conversations), seed and load (a share of the fleet's capacity, as
# `kvepp-sim gen-trace --target-load` estimates it), a Mooncake-format trace is generated and
# replayed through Envoy and kvepp on 8 simulated engines under each policy; then
# bench/generalization.py prints, per structure, load and policy, the median and the spread
# (min–max over the seeds) of the hit ratio (of the capacity ceiling and of the best reference
# placement's), TTFT p50/p90, e2e p90, ITL p90 (and the best reference's share of them), and
# imbalance; then the targets for `default` (the shipped configuration), run by run. Release
# build (PREBUILT=1: use target/release as it is);
# results in bench/results/generalization/<structure>-s<seed>-l<load>/.
#
# Environment (defaults): SEEDS="1 2 3 4 5", LOADS="0.5 0.7 0.9 1.2",
# STRUCTURES="system-prompts conversations", REQUESTS=1000,
# POLICIES=round-robin,approximate-prefix,precise-kv,default,clairvoyant,clairvoyant-completion. The full grid is 40
# replays of 5 policies (hours on 2 cores); e.g. SEEDS="1 2" LOADS="0.5 0.9" REQUESTS=300 for a
# look.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${PREBUILT:-}" ] || cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
seeds=${SEEDS:-"1 2 3 4 5"}
loads=${LOADS:-"0.5 0.7 0.9 1.2"}
structures=${STRUCTURES:-"system-prompts conversations"}
requests=${REQUESTS:-1000}
policies=${POLICIES:-round-robin,approximate-prefix,precise-kv,default,clairvoyant,clairvoyant-completion}
root=bench/results/generalization
for structure in $structures; do
  for seed in $seeds; do
    for load in $loads; do
      dir=$root/$structure-s$seed-l$load
      mkdir -p "$dir"
      target/release/kvepp-sim gen-trace --structure "$structure" --seed "$seed" \
        --requests "$requests" --target-load "$load" --engines 8 --out "$dir/trace.jsonl"
      target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml \
        --workload mooncake --trace "$dir/trace.jsonl" --trace-requests "$requests" --speed 1 \
        --engines 8 --trace-engines 8 --policy "$policies" --out "$dir" "$@" > "$dir/run.log"
    done
  done
done
python3 bench/generalization.py "$root" default | tee "$root/summary.md"
