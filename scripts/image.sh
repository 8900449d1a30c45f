#!/usr/bin/env bash
# Builds kvepp's two container images from scripts/Containerfile (FROM scratch, no registry) and
# tags them as the manifests name them: kvepp/kvepp:<version> and kvepp/worker-agent:<version>.
#
#   scripts/image.sh
#
# Needs the Rust musl target and musl-gcc (for the static binaries) and podman (or docker); as
# root on Debian it installs what is missing. CONTAINER_ENGINE picks the engine (default: podman,
# else docker); CONTAINER_ENGINE_FLAGS are passed to it before `build` (e.g.
# `--storage-driver vfs` where overlay mounts are not allowed). Push with
# `podman push kvepp/kvepp:<version> <registry>/kvepp/kvepp:<version>`.
set -euo pipefail
cd "$(dirname "$0")/.."
target=x86_64-unknown-linux-musl
missing() {
  # $1: what is missing, $2: the command that installs it.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "image.sh: installing $1: $2" >&2
    eval "$2" >&2 || { apt-get update -qq >&2 && eval "$2" >&2; }
  else
    echo "image.sh: $1 is missing; install it with: $2" >&2
    exit 1
  fi
}
rustup target list --installed | grep -qx "$target" ||
  missing "the Rust target $target" "rustup target add $target"
command -v musl-gcc >/dev/null ||
  missing "musl-gcc" "apt-get install -y -qq --no-install-recommends musl-tools"
[ -f /etc/ssl/certs/ca-certificates.crt ] ||
  missing "the CA bundle" "apt-get install -y -qq --no-install-recommends ca-certificates"
engine=${CONTAINER_ENGINE:-$(command -v podman || command -v docker || echo podman)}
if [ "$(basename "$engine")" = podman ] && ! command -v "$engine" >/dev/null; then
  missing "podman" "apt-get install -y -qq podman buildah runc"
fi
read -r -a engine_flags <<<"${CONTAINER_ENGINE_FLAGS:-}"

# Static binaries: release code, stripped (Cargo.toml's [profile.container]).
cargo build --locked --quiet --profile container --target "$target" --bin kvepp --bin kvepp-agent
out=target/$target/container

# The build context holds only what the images carry.
ctx=target/image/context
rm -rf "$ctx"
mkdir -p "$ctx"
cp "$out/kvepp" "$out/kvepp-agent" LICENSE scripts/Containerfile "$ctx/"
cp /etc/ssl/certs/ca-certificates.crt "$ctx/"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$ctx/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' >"$ctx/group"

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
sha=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
for stage in epp worker-agent; do
  case $stage in
    epp) image=kvepp/kvepp:$version ;;
    worker-agent) image=kvepp/worker-agent:$version ;;
  esac
  "$engine" "${engine_flags[@]}" build --quiet -f "$ctx/Containerfile" --target "$stage" \
    --build-arg "KVEPP_VERSION=$version" --build-arg "KVEPP_GIT_SHA=$sha" -t "$image" "$ctx" >/dev/null
  size=$("$engine" "${engine_flags[@]}" image inspect --format '{{.Size}}' "$image")
  echo "built $image ($(( size / 1024 / 1024 )) MiB)"
done
