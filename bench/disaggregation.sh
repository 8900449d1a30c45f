#!/usr/bin/env bash
# Prefill/decode disaggregation across two zones: 8 simulated engines (4 prefill, 4 decode; engine
# i in zone a or b by parity, each on its own host), the shared-prefix workload, precise KV-aware
# routing, with KV transfers priced by the simulator's topology (same host < same zone < cross
# zone; SimParams transfer_qos / cross_domain_qos). Compares the decode pick with topology off,
# the hard zone filter (kv_transfer_topology_level: zone) and the soft preference
# (kv_transfer_weight). Release build; results in bench/results/disaggregation/.
# Usage: [DURATION=s] [RATE=r] bench/disaggregation.sh [other bench-routing flags].
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
envoy=$(scripts/install-envoy.sh)
target/release/kvepp-bench bench-routing --envoy "$envoy" --kvepp-config bench/kvepp.yaml \
  --workload shared-prefix --engines 8 --prefill-engines 4 --zones a,b --policy precise-kv \
  --topology off,hard,soft,hard-soft --duration "${DURATION:-20}" --rate "${RATE:-12}" --groups 24 \
  --out bench/results/disaggregation "$@"
