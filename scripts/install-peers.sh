#!/usr/bin/env bash
# Builds the peer Endpoint Pickers kvepp is compared with, from the Go module proxy at pinned
# versions, and prints where they are, one `NAME=path` line each:
#   REFERENCE_EPP_BIN  the Gateway API Inference Extension's reference EPP at REFERENCE_EPP_VERSION
#                      (sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp: since v1.6 the
#                      project's reference picker is this lightweight one, round robin over the
#                      pool's ready pods, built for the conformance suite)
# Each is cached by version under ${KVEPP_TOOLS_CACHE:-~/.cache/kvepp/tools}. llm-d's router
# (github.com/llm-d/llm-d-router) is not built: the module proxy this project uses refuses it
# (`go list -m -versions github.com/llm-d/llm-d-router`: 403 "This module version is not
# available"); docs/performance.md says so.
set -euo pipefail
cache="${KVEPP_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvepp/tools}"
reference_version="${REFERENCE_EPP_VERSION:-v1.6.2}"
bin="$cache/reference-epp-$reference_version/lwepp"
if [ ! -x "$bin" ]; then
  command -v go >/dev/null || {
    echo "install-peers: go not found: install Go 1.26 or newer to build the reference EPP" >&2
    exit 1
  }
  start=$SECONDS
  mkdir -p "$(dirname "$bin")"
  # Its go.mod has no replace directive: go install builds exactly that version.
  GOBIN="$(dirname "$bin")" go install -trimpath \
    "sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp@$reference_version" >&2
  echo "install-peers: built the reference EPP $reference_version in $(( SECONDS - start )) s" >&2
fi
echo "REFERENCE_EPP_BIN=$bin"
