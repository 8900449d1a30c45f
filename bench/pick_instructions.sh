#!/usr/bin/env bash
# Instructions per KV-aware pick (`KvState::rank`), counted by valgrind's callgrind: the same on
# any x86-64 machine and free of timer noise. For each size, the pick bench runs its setup with 0
# and with N picks; the difference over N is one pick. Prints a table with each size's count
# beside the first size's (the target: 4000 endpoints ≤ 1.5× 1000 at 128k tokens).
# Each size is counted twice: ordered picks (the default) and the full scan (`--scan`, the
# reference). `--holders-every K`: every K-th endpoint holds the prompt's system prompt (2: the
# bench's default fleet, where half the fleet holds it; 64: few holders). `--varied-loads`: each
# endpoint's active request has its own length, so loads differ (by default they are equal and
# endpoints of one kind tie exactly, which the scan's tie-break makes a pick read in full).
# `--live-bookings K`: K picks of the prompt are booked and kept before the counted picks
# (requests in flight with the whole prompt active, as other threads' bookings are).
# Usage: bench/pick_instructions.sh [--endpoints 1000,4000] [--tokens-k 128] [--picks 100]
#        [--holders-every 2] [--varied-loads] [--live-bookings 0]
# PREBUILT=1 uses the bench binary already in target/release/deps; PICK_BIN=<path> another
# build's (to compare two builds on one machine).
set -euo pipefail
cd "$(dirname "$0")/.."
endpoints=1000,4000 tokens=128 picks=100 every=2 varied= live=0
while [ $# -gt 0 ]; do
  case "$1" in
    --endpoints) endpoints=$2; shift 2 ;;
    --tokens-k) tokens=$2; shift 2 ;;
    --picks) picks=$2; shift 2 ;;
    --holders-every) every=$2; shift 2 ;;
    --varied-loads) varied=--varied-loads; shift ;;
    --live-bookings) live=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
[ "${PREBUILT:-0}" = 1 ] || [ -n "${PICK_BIN:-}" ] || cargo bench --locked -p kvepp-core --bench pick --no-run >&2
bin=${PICK_BIN:-$(ls -t target/release/deps/pick-* | grep -v '\.d$' | head -1)}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Instructions callgrind collected for one run of the bench with `--kv-picks $3` (and `$4`).
count() {
  valgrind --tool=callgrind --callgrind-out-file="$tmp/out" --log-file="$tmp/log" \
    "$bin" --bench --endpoints "$1" --tokens-k "$2" --kv-picks "$3" --holders-every "$every" --live-bookings "$live" $varied $4 >/dev/null
  sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$tmp/log"
}
echo "## Instructions per KV-aware pick (callgrind, $picks picks a size, setup subtracted; every $every-th endpoint holds the system prompt${varied:+, loads varied}, $live bookings of the prompt live)"
echo
echo "| endpoints | prompt tokens | ordered pick | ÷ first size | full scan | ÷ first size | ordered ÷ scan |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
first="" first_scan=""
for n in ${endpoints//,/ }; do
  for k in ${tokens//,/ }; do
    base=$(count "$n" "$k" 0 "")
    with=$(count "$n" "$k" "$picks" "")
    # The scan's own setup (the live bookings' picks are scans too).
    base_scan=$(count "$n" "$k" 0 --scan)
    scan=$(count "$n" "$k" "$picks" --scan)
    per=$(( (with - base) / picks ))
    per_scan=$(( (scan - base_scan) / picks ))
    first=${first:-$per}
    first_scan=${first_scan:-$per_scan}
    r=$(awk -v a="$per" -v b="$first" 'BEGIN { printf "%.2f", a / b }')
    rs=$(awk -v a="$per_scan" -v b="$first_scan" 'BEGIN { printf "%.2f", a / b }')
    ro=$(awk -v a="$per" -v b="$per_scan" 'BEGIN { printf "%.2f", a / b }')
    echo "| $n | ${k}k | $per | ${r}× | $per_scan | ${rs}× | ${ro}× |"
  done
done
