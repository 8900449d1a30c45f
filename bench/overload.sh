#!/usr/bin/env bash
# Goodput under overload: for each load (a multiple of the fleet's capacity, as
# `kvepp-sim gen-trace --target-load` estimates it) and seed, a generated Mooncake-format trace is
# replayed through Envoy and kvepp (the default policy) on 8 simulated engines twice: with the
# shipped defaults (flow control off: every request is routed and waits at its engine) and with
# bench/overload.yaml (flow control on, a 1 s TTFT objective). bench/overload.py then prints per
# load: the share of requests admitted, the TTFT of the admitted, the share of admitted within
# the objective, goodput (requests/s within it) and how soon refusals came, off against on.
# Release build; results in bench/results/overload/<structure>-s<seed>-l<load>-<off|on>/.
#
# Environment (defaults): SEEDS="1 2 3", LOADS="1.5 2.0", STRUCTURE=system-prompts, REQUESTS=600,
# OBJECTIVE_MS=1000 (the SLO the report counts against; keep it equal to bench/overload.yaml's).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${PREBUILT:-}" ] || cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
seeds=${SEEDS:-"1 2 3"}
loads=${LOADS:-"1.5 2.0"}
structure=${STRUCTURE:-system-prompts}
requests=${REQUESTS:-600}
objective=${OBJECTIVE_MS:-1000}
root=bench/results/overload
for seed in $seeds; do
  for load in $loads; do
    run=$root/$structure-s$seed-l$load
    mkdir -p "$run-off" "$run-on"
    target/release/kvepp-sim gen-trace --structure "$structure" --seed "$seed" \
      --requests "$requests" --target-load "$load" --engines 8 --out "$run-off/trace.jsonl"
    cp "$run-off/trace.jsonl" "$run-on/trace.jsonl"
    for mode in off on; do
      config=bench/kvepp.yaml
      [ "$mode" = on ] && config=bench/overload.yaml
      target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config "$config" \
        --workload mooncake --trace "$run-$mode/trace.jsonl" --trace-requests "$requests" \
        --speed 1 --engines 8 --trace-engines 8 --policy default --slo-ttft-ms "$objective" \
        --drain 180 --out "$run-$mode" > "$run-$mode/run.log"
    done
  done
done
python3 bench/overload.py "$root" "$objective" | tee "$root/summary.md"
