#!/usr/bin/env bash
# Lints the Helm chart manifests/helm/kvepp with its defaults and with each values file of
# manifests/helm/values (helm from $HELM_BIN, else scripts/install-kube.sh), then checks that a
# value of the wrong type or an unknown key is refused with its path named (values.schema.json).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
helm=${HELM_BIN:-$("$root/scripts/install-kube.sh" | sed -n 's/^HELM_BIN=//p')}
chart="$root/manifests/helm/kvepp"
"$helm" lint --strict "$chart" >/dev/null
for values in "$root"/manifests/helm/values/*.yaml; do
  "$helm" lint --strict "$chart" -f "$values" >/dev/null || {
    "$helm" lint --strict "$chart" -f "$values" >&2
    exit 1
  }
done
# refused SET PATH: `helm lint --set SET` fails and names PATH.
refused() {
  local out
  if out=$("$helm" lint "$chart" --set "$1" 2>&1); then
    echo "helm-lint: --set $1 was accepted; values.schema.json should refuse it" >&2
    exit 1
  fi
  grep -qF "$2" <<<"$out" || {
    echo "helm-lint: --set $1 was refused without naming $2:" >&2
    echo "$out" >&2
    exit 1
  }
}
refused replicaCount=two "/replicaCount"
refused pool.targetPort=http "/pool/targetPort"
refused flowControl.enabled=maybe "/flowControl/enabled"
refused replicas=2 "replicas"
refused pool.failureMode=Sometimes "/pool/failureMode"
echo "helm-lint: chart linted with $(ls "$root"/manifests/helm/values/*.yaml | wc -l) values files; wrong types refused by name"
