#!/usr/bin/env bash
# Builds the Kubernetes tooling of the tests from the Go module proxy at pinned versions and prints
# where it is, one `NAME=path` line each:
#   ETCD_BIN            etcd (go.etcd.io/etcd/server/v3, the version k8s.io/kubernetes requires)
#   KUBE_APISERVER_BIN  kube-apiserver (k8s.io/kubernetes/cmd/kube-apiserver)
#   HELM_BIN            helm (helm.sh/helm/v4/cmd/helm)
# The pins live in scripts/kube-tools/go.mod (etcd, kube-apiserver) and HELM_VERSION below. Each
# binary is cached by version under ${KVEPP_TOOLS_CACHE:-~/.cache/kvepp/tools}; a cached one is
# reused as it is. Needs Go (1.26 or newer) and the module proxy on the first run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mod="$root/scripts/kube-tools"
cache="${KVEPP_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvepp/tools}"
helm_version="${HELM_VERSION:-v4.3.2}"
version_of() { awk -v m="$1" '$1 == m { print $2; exit }' "$mod/go.mod"; }
kube_version=$(version_of k8s.io/kubernetes)
etcd_version=$(version_of go.etcd.io/etcd/server/v3)

need_go() {
  command -v go >/dev/null || {
    echo "install-kube: go not found: install Go 1.26 or newer (Debian: apt-get install golang-go) to build $1" >&2
    exit 1
  }
}

# build NAME VERSION PACKAGE [LDFLAGS]: builds PACKAGE inside scripts/kube-tools unless the cache
# has it.
build() {
  local name=$1 version=$2 pkg=$3 ldflags=${4:-} out="$cache/$1-$2/$1"
  if [ ! -x "$out" ]; then
    need_go "$name"
    local start=$SECONDS
    mkdir -p "$(dirname "$out")"
    (cd "$mod" && go build -trimpath -ldflags "$ldflags" -o "$out.tmp" "$pkg") >&2
    mv "$out.tmp" "$out"
    echo "install-kube: built $name $version in $(( SECONDS - start )) s" >&2
  fi
  echo "$out"
}

etcd=$(build etcd "$etcd_version" go.etcd.io/etcd/server/v3)
# The version the API server reports (/version, and what clients such as helm compare against),
# stamped as Kubernetes' own release builds do.
minor=$(echo "$kube_version" | cut -d. -f2)
v=k8s.io/component-base/version
apiserver=$(build kube-apiserver "$kube_version" k8s.io/kubernetes/cmd/kube-apiserver \
  "-X $v.gitVersion=$kube_version -X $v.gitMajor=1 -X $v.gitMinor=$minor -X $v.gitTreeState=clean")

helm="$cache/helm-$helm_version/helm"
if [ ! -x "$helm" ]; then
  need_go helm
  start=$SECONDS
  mkdir -p "$(dirname "$helm")"
  # helm's own go.mod has no replace directive: go install builds it at exactly that version.
  GOBIN="$(dirname "$helm")" go install -trimpath "helm.sh/helm/v4/cmd/helm@$helm_version" >&2
  echo "install-kube: built helm $helm_version in $(( SECONDS - start )) s" >&2
fi

echo "ETCD_BIN=$etcd"
echo "KUBE_APISERVER_BIN=$apiserver"
echo "HELM_BIN=$helm"
