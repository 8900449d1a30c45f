#!/usr/bin/env bash
# Speculative indexing on a burst workload: every 500 ms a prefix no engine has seen arrives with
# 8 requests within 10 ms, faster than the engines' KV events confirm it. The default
# configuration runs twice, with `router.speculative` on (the default) and off, on 4 simulated
# engines behind Envoy; the table gives the engines' prefix-cache hits and the latencies of each.
# Release build; results in bench/results/speculative/{on,off}/. About 3 minutes on 2 cores.
# PREBUILT=1 uses target/release as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -n "${PREBUILT:-}" ] || cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
out=bench/results/speculative
mkdir -p "$out"
off_config=$(mktemp --suffix=.yaml)
trap 'rm -f "$off_config"' EXIT
printf 'log_level: warn\nrouter:\n  speculative: false\n' >"$off_config"
for mode in on off; do
  config=bench/kvepp.yaml
  [ "$mode" = off ] && config=$off_config
  target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config "$config" \
    --workload burst --policy default --engines 4 --duration 20 --out "$out/$mode" "$@" >&2
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("| speculative indexing | requests (failed) | hit ratio (of capacity ceiling) | TTFT p50 / p90 ms | e2e p50 / p90 ms |")
print("|---|---|---|---|---|")
rows = {}
for mode in ("on", "off"):
    [w] = json.load(open(f"{out}/{mode}/results.json"))
    [r] = w["results"]
    rows[mode] = r
    cap = w["ceilings"]["capacity"]
    share = f"{100 * r['hit_ratio'] / cap:.0f}%" if cap else "-"
    print(f"| {mode} | {r['requests']} ({r['failed']}) | {100 * r['hit_ratio']:.1f}% ({share}) | "
          f"{r['ttft_ms'][0]:.0f} / {r['ttft_ms'][1]:.0f} | {r['e2e_ms'][0]:.0f} / {r['e2e_ms'][1]:.0f} |")
on, off = rows["on"], rows["off"]
if off["hit_ratio"] > 0:
    print(f"\nhits with speculative indexing ÷ without: {on['hit_ratio'] / off['hit_ratio']:.2f}×")
PY
