#!/usr/bin/env bash
# Unpacks the Python files of PyPI's `sglang` wheel (pinned, checked by digest) that the tests run as
# SGLang's own router-facing code (tests/fixtures/sglang/peer.py: its KV-event recorder and
# publisher, its metrics collector) into the ignored folder .venv/sglang-wheel/, and prints it.
# SGLang itself does not run here (its kernels need CUDA); nothing of the wheel is installed.
# Idempotent: downloads nothing when the files are there from the pinned wheel.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir="$root/.venv/sglang-wheel"
version=0.5.23
want=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937
py=${PYTHON:-python3}
stamp="$dir/.sglang-$version-$want"
files="sglang/srt/disaggregation/kv_events.py sglang/srt/mem_cache/events.py
sglang/srt/observability/metrics_collector.py sglang/srt/observability/utils.py
sglang/srt/observability/scheduler_stage_metrics.py sglang/srt/utils/gauge_histogram.py"
if [ -f "$stamp" ]; then
  echo "$dir"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.11 --platform manylinux_2_34_x86_64 -d "$tmp" "sglang==$version" >&2
wheel=$(ls "$tmp"/sglang-"$version"-*.whl)
sha256sum "$wheel" | grep -q "^$want " || { echo "install-sglang-peer: $wheel does not have the pinned sha256 $want" >&2; exit 1; }
rm -rf "$dir"
mkdir -p "$dir"
"$py" - "$wheel" "$dir" $files <<'PY'
import sys, zipfile
wheel, out, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for n in names:
        z.extract(n, out)
PY
touch "$stamp"
echo "$dir"
