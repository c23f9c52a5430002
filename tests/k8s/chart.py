"""Rendering the Helm chart for tests, and the KubeRay CRD schema it must satisfy.

The chart is rendered by Helm's own Go SDK (``helm-python-sdk``), so templates, the values
schema and ``fail`` calls behave exactly as under ``helm install``. The CRD comes from the shared
folder beside the repository (``../shared/k8s-crds``), as CI lays it out.
"""

from __future__ import annotations

import copy
import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "chart"
EXAMPLES = ROOT / "k8s" / "values"
CRDS = ROOT.parent / "shared" / "k8s-crds"
RAYSERVICE_CRD = CRDS / "ray.io_rayservices.yaml"
RELEASE = "pagedserve"


@cache
def render_script():
    """scripts/render_k8s.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "scripts" / "render_k8s.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render(values: dict[str, Any] | None = None, release: str = RELEASE) -> dict[str, Any]:
    """The chart's objects for ``values``, keyed by kind (one object of each kind)."""
    docs = render_script().render_documents(values, release=release)
    objects = [yaml.safe_load(doc) for doc in docs]
    by_kind = {obj["kind"]: obj for obj in objects}
    assert len(by_kind) == len(objects), f"two objects of one kind: {[o['kind'] for o in objects]}"
    return by_kind


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def app_args(rayservice: dict[str, Any]) -> dict[str, Any]:
    (app,) = serve_config(rayservice)["applications"]
    return app["args"]


def head(rayservice: dict[str, Any]) -> dict[str, Any]:
    return rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]


def gpu_group(rayservice: dict[str, Any]) -> dict[str, Any]:
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]


@cache
def rayservice_schema() -> dict[str, Any]:
    """The RayService v1 ``openAPIV3Schema``, made strict: an object with listed properties
    rejects any other key, as ``kubectl apply --validate=strict`` does (the API server would
    silently drop it, hiding a typo)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 1 MB of YAML
    crd = yaml.load(RAYSERVICE_CRD.read_text(), Loader=loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for item in node:
            _strict(item)
    return node
