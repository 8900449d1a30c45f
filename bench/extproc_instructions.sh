#!/usr/bin/env bash
# Instructions per request on the ext_proc path (callgrind): kvepp and the floor EPP behind one
# Envoy, ~100k-token bodies, one request at a time. Needs valgrind (Debian package). With
# PREBUILT=1 the release binaries already built are used as they are.
# Usage: bench/extproc_instructions.sh [--modes approximate,token_ids,token_ids-fresh] [--requests 20] [--kvepp-bin A,B]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/prereqs.sh
command -v valgrind >/dev/null || apt-get install -y -q valgrind >&2
[ "${PREBUILT:-0}" = 1 ] || cargo build --locked --release --quiet --bin kvepp --example floor_epp
exec .venv/bin/python bench/extproc_instructions.py --envoy "$envoy" "$@"
