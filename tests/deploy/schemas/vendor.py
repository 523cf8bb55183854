"""Refresh the vendored JSON schemas from the registry packages that publish them.

The tests validate deploy/ offline, so the schemas live in the repository. Re-run this after
fetching newer packages (nothing here touches the network):

    npm pack dclint                                   # schemas/compose.schema.json
    pip download --no-deps kubernetes-validate        # kubernetes-json-schema per k8s version
    pip install cloudcoil-models-prometheus-operator  # ServiceMonitor, PrometheusRule models
    python tests/deploy/schemas/vendor.py --dclint DIR --kubernetes-validate DIR

Kubernetes schemas are the package's ``*-local-strict`` files (unknown fields are errors), with
``_definitions.json`` cut down to the definitions our kinds reach. The ServiceMonitor
and PrometheusRule schemas are generated from cloudcoil's pydantic models of the
prometheus-operator CRDs (no registry package ships them as JSON schema), made strict the same way
(``additionalProperties: false`` on every object that lists its properties).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
K8S_VERSION = "v1.34.0"
K8S_KINDS = ("daemonset-apps-v1.json", "service-v1.json", "namespace-v1.json")
_REF = re.compile(r'#/\$defs/([^"]+)"')


def _closure(defs: dict[str, Any], roots: list[Any]) -> dict[str, Any]:
    todo = {name for root in roots for name in _REF.findall(json.dumps(root))}
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo |= set(_REF.findall(json.dumps(defs[name]))) - seen
    return {name: defs[name] for name in sorted(seen)}


def vendor_kubernetes(package_dir: Path) -> None:
    schemas = package_dir / "kubernetes_validate" / "kubernetes-json-schema"
    src = schemas / f"{K8S_VERSION}-local-strict"
    dst = HERE / "kubernetes" / K8S_VERSION
    dst.mkdir(parents=True, exist_ok=True)
    kinds = [json.loads((src / k).read_text()) for k in K8S_KINDS]
    for name in K8S_KINDS:
        shutil.copyfile(src / name, dst / name)
    defs = json.loads((src / "_definitions.json").read_text())
    defs["$defs"] = _closure(defs["$defs"], kinds)
    (dst / "_definitions.json").write_text(json.dumps(defs, indent=1) + "\n")


def _strict(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)


def vendor_prometheus_operator() -> None:
    from cloudcoil.models.prometheus_operator import v1  # type: ignore[import-not-found]

    for kind in ("ServiceMonitor", "PrometheusRule"):
        schema = getattr(v1, kind).model_json_schema(by_alias=True, mode="validation")
        _strict(schema)
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        out = HERE / "monitoring.coreos.com" / f"{kind.lower()}-v1.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(schema, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dclint", type=Path, required=True, help="unpacked dclint npm package")
    parser.add_argument("--kubernetes-validate", type=Path, required=True,
                        help="unpacked kubernetes-validate wheel")
    args = parser.parse_args()
    shutil.copyfile(args.dclint / "schemas" / "compose.schema.json", HERE / "compose-spec.json")
    vendor_kubernetes(args.kubernetes_validate)
    vendor_prometheus_operator()


if __name__ == "__main__":
    main()
