#!/usr/bin/env bash
# Instructions per KV-aware pick (`KvState::rank`), counted by valgrind's callgrind: the same on
# any x86-64 machine and free of timer noise. For each size, the pick bench runs its setup with 0
# and with N picks; the difference over N is one pick. Prints a table with each size's count
# beside the first size's (the issue's target: 4000 endpoints ≤ 1.5× 1000 at 128k tokens).
# Usage: bench/pick_instructions.sh [--endpoints 1000,4000] [--tokens-k 128] [--picks 100]
# PREBUILT=1 uses the bench binary already in target/release/deps.
set -euo pipefail
cd "$(dirname "$0")/.."
endpoints=1000,4000 tokens=128 picks=100
while [ $# -gt 0 ]; do
  case "$1" in
    --endpoints) endpoints=$2; shift 2 ;;
    --tokens-k) tokens=$2; shift 2 ;;
    --picks) picks=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
[ "${PREBUILT:-0}" = 1 ] || cargo bench --locked -p kvepp-core --bench pick --no-run >&2
bin=$(ls -t target/release/deps/pick-* | grep -v '\.d$' | head -1)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Instructions callgrind collected for one run of the bench with `--kv-picks $3`.
count() {
  valgrind --tool=callgrind --callgrind-out-file="$tmp/out" --log-file="$tmp/log" \
    "$bin" --bench --endpoints "$1" --tokens-k "$2" --kv-picks "$3" >/dev/null
  sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$tmp/log"
}
echo "## Instructions per KV-aware pick (callgrind, $picks picks a size, setup subtracted)"
echo
echo "| endpoints | prompt tokens | instructions per pick | ÷ first size |"
echo "|---:|---:|---:|---:|"
first=""
for n in ${endpoints//,/ }; do
  for k in ${tokens//,/ }; do
    base=$(count "$n" "$k" 0)
    with=$(count "$n" "$k" "$picks")
    per=$(( (with - base) / picks ))
    first=${first:-$per}
    ratio=$(awk -v a="$per" -v b="$first" 'BEGIN { printf "%.2f", a / b }')
    echo "| $n | ${k}k | $per | ${ratio}× |"
  done
done
