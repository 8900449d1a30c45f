#!/usr/bin/env bash
# Replica sync's cost to the replica receiving it: in-process picks (select + atomic booking + free,
# as /select_and_reserve runs them) over 100 workers with 2k-token prompts, alone, while 3 peers
# publish 1000 admission+free pairs/s each over real ZMQ, and while one peer publishes as fast as it
# can (the event rate a replica absorbs while serving picks). Release build; prints a markdown
# table. Extra arguments go to `kvepp-bench bench-replica`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked --release --quiet -p kvepp-bench -p kvepp-sim
target/release/kvepp-bench bench-replica "$@"
