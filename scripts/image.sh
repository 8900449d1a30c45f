#!/usr/bin/env bash
# Builds kvepp's two container images from ./Containerfile and tags them exactly as the manifests
# reference them (kvepp/kvepp:<version>, kvepp/worker-agent:<version>). Needs podman or docker;
# push with `podman push kvepp/kvepp:<version> <registry>/kvepp/kvepp:<version>` (or retag).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${CONTAINER_ENGINE:-$(command -v podman || command -v docker || true)}
if [ -z "$engine" ]; then
  echo "image.sh: no podman or docker here; set CONTAINER_ENGINE" >&2
  exit 1
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
sha=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
for target in epp worker-agent; do
  case $target in
    epp) image=kvepp/kvepp:$version ;;
    worker-agent) image=kvepp/worker-agent:$version ;;
  esac
  "$engine" build -f Containerfile --target "$target" --build-arg "KVEPP_GIT_SHA=$sha" -t "$image" .
  echo "built $image"
done
