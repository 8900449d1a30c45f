"""Renders every Kustomize overlay under manifests/kubernetes (and the CRDs) with `kubectl kustomize`,
and the Helm chart manifests/helm/kvepp with each values file of manifests/helm/values
(`helm template`, helm from $HELM_BIN or scripts/install-kube.sh), and validates the output offline: built-in kinds against the Kubernetes schemas PyPI's
kubernetes-validate ships (strict: an unknown field fails), custom resources against the
openAPIV3Schema of the shipped CRD that serves their apiVersion and kind. Kinds whose CRDs come
with other projects (Gateway API, Envoy Gateway) are listed as not validated here.

    .venv/bin/python scripts/validate-manifests.py      # exit 1 naming every invalid object
"""

import os
import subprocess
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MANIFESTS = os.path.join(ROOT, "manifests", "kubernetes")
# The Kubernetes version whose schemas the built-in kinds are checked against.
KUBERNETES_VERSION = "1.32.0"
# CRDs of other projects the overlays use; their schemas do not ship here.
EXTERNAL_GROUPS = ("gateway.networking.k8s.io/", "gateway.envoyproxy.io/")


def render(path):
    out = subprocess.run(
        ["kubectl", "kustomize", path], check=True, capture_output=True, text=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def helm_bin():
    if os.environ.get("HELM_BIN"):
        return os.environ["HELM_BIN"]
    out = subprocess.run(
        [os.path.join(ROOT, "scripts", "install-kube.sh")], check=True, capture_output=True, text=True
    ).stdout
    return next(l.split("=", 1)[1] for l in out.splitlines() if l.startswith("HELM_BIN="))


def helm_renderings():
    helm = helm_bin()
    chart = os.path.join(ROOT, "manifests", "helm", "kvepp")
    values_dir = os.path.join(ROOT, "manifests", "helm", "values")
    out = []
    for v in sorted(os.listdir(values_dir)):
        values = os.path.join(values_dir, v)
        text = subprocess.run(
            [helm, "template", "kvepp", chart, "--namespace", "default", "-f", values],
            check=True, capture_output=True, text=True,
        ).stdout
        out.append((f"helm -f {v}", [d for d in yaml.safe_load_all(text) if d]))
    return out


def crd_schemas(crds):
    schemas = {}
    for crd in crds:
        group = crd["spec"]["group"]
        kind = crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            schemas[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return schemas


def main():
    crds = render(os.path.join(MANIFESTS, "crds"))
    schemas = crd_schemas(crds)
    overlays = sorted(os.listdir(os.path.join(MANIFESTS, "overlays")))
    failures, checked, external = [], 0, set()
    targets = [("crds", crds)] + [
        (f"overlays/{o}", render(os.path.join(MANIFESTS, "overlays", o))) for o in overlays
    ] + helm_renderings()
    for where, docs in targets:
        for d in docs:
            api, kind, name = d["apiVersion"], d["kind"], d["metadata"]["name"]
            what = f"{where}: {api} {kind} {name}"
            if (api, kind) in schemas:
                try:
                    jsonschema.validate(d, schemas[(api, kind)])
                except jsonschema.ValidationError as e:
                    failures.append(f"{what}: {e.message} at {list(e.absolute_path)}")
            elif api.startswith(EXTERNAL_GROUPS):
                external.add(f"{api} {kind}")
                continue
            else:
                try:
                    kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
                except (kubernetes_validate.ValidationError,
                        kubernetes_validate.SchemaNotFoundError,
                        kubernetes_validate.InvalidSchemaError) as e:
                    failures.append(f"{what}: {getattr(e, 'message', e)}")
            checked += 1
    for f in failures:
        print(f"invalid: {f}", file=sys.stderr)
    print(
        f"validate-manifests: {checked} objects in {len(targets)} renderings valid"
        f" (Kubernetes {KUBERNETES_VERSION}, shipped CRDs)"
        + (f"; not validated here (their CRDs ship with their projects): {', '.join(sorted(external))}"
           if external else "")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
