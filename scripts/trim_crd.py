"""Trim an upstream CRD for the offline validation of k8s/ (tests/test_deploy_k8s.py): the schema of the served
version is kept field for field, except that every inlined core/v1 PodTemplateSpec and PodSpec-shaped override is
replaced by ``x-kubernetes-preserve-unknown-fields`` (the test validates those against the real core/v1 schema of
the ``kubernetes-validate`` package instead), descriptions and the status are dropped.

    python scripts/trim_crd.py UPSTREAM.yaml OUT.yaml --version v1alpha1 --source 'kubeflow/trainer@<commit> PATH'
"""

from __future__ import annotations

import argparse

import yaml

_POD_FIELDS = ("containers", "initContainers", "volumes", "affinity", "tolerations", "imagePullSecrets",
               "schedulingGates", "topologySpreadConstraints", "securityContext", "volumeMounts", "env", "envFrom",
               "resources")
_TRIMMED = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


class _Dumper(yaml.SafeDumper):
    """Lists indented under their key (the k8s/ yamllint style)."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def _trimmed(node: dict) -> dict:
    """An array keeps its type (its items become free-form), an object becomes free-form."""
    if node.get("type") == "array":
        return {"type": "array", "items": dict(_TRIMMED)}
    return dict(_TRIMMED)


def _is_pod_template(node: dict) -> bool:
    spec = (node.get("properties") or {}).get("spec") or {}
    return "containers" in (spec.get("properties") or {}) and "metadata" in (node.get("properties") or {})


def trim(node, key: str = ""):
    if isinstance(node, list):
        return [trim(v) for v in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "object" and _is_pod_template(node):
        return dict(_TRIMMED)
    out = {}
    for k, v in node.items():
        if k == "description":
            continue
        if k == "properties":
            out[k] = {name: (_trimmed(sub) if name in _POD_FIELDS and isinstance(sub, dict) and sub.get("type") in
                             ("array", "object") and name != "resources" else trim(sub, name))
                      for name, sub in v.items()}
            continue
        out[k] = trim(v, k)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("upstream")
    parser.add_argument("out")
    parser.add_argument("--version", required=True)
    parser.add_argument("--source", required=True, help="REPO@COMMIT PATH")
    args = parser.parse_args()
    docs = [d for d in yaml.safe_load_all(open(args.upstream, encoding="utf-8")) if d]
    (crd,) = docs
    crd["metadata"] = {"name": crd["metadata"]["name"]}
    crd["spec"]["versions"] = [v for v in crd["spec"]["versions"] if v["name"] == args.version]
    for v in crd["spec"]["versions"]:
        schema = v["schema"]["openAPIV3Schema"]
        schema["properties"].pop("status", None)
        v["schema"]["openAPIV3Schema"] = trim(schema)
    header = (f"# {crd['spec']['names']['kind']} CRD ({crd['spec']['group']}/{args.version}), TRIMMED by "
              "scripts/trim_crd.py for the offline\n# validation of k8s/ (tests/test_deploy_k8s.py). "
              "NOT for installing: "
              "install the controller's own manifests.\n"
              "# Source: " + args.source.replace(" ", "\n#   ", 1) + "\n"
              "# Kept: the served version's schema field for field (types, enums, "
              "required, CEL rules). Trimmed: descriptions,\n# the status, and every inlined core/v1 pod template or "
              "pod-spec field (preserve-unknown-fields here; the test\n# validates those against the core/v1 schema "
              "of kubernetes-validate).\n")
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(header)
        for line in yaml.dump(crd, Dumper=_Dumper, sort_keys=False, width=10**6).splitlines():
            # one scalar per line (a comment after a folded line would land inside it): long rules are marked
            f.write(line + ("  # yamllint disable-line rule:line-length\n" if len(line) > 130 else "\n"))


if __name__ == "__main__":
    main()
