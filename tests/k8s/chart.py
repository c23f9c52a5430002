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
DOCKERFILE = ROOT / "deploy" / "Dockerfile"

# What the chart is rendered with in the parametrised tests: its defaults and every example.
CASES = ["defaults", *sorted(p.name for p in EXAMPLES.glob("*.yaml"))]


@cache
def render_script():
    """scripts/render_k8s.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "scripts" / "render_k8s.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render_objects(values: dict[str, Any] | None = None,
                   release: str = RELEASE) -> list[dict[str, Any]]:
    """Every object the chart renders for ``values``, in apply order."""
    docs = render_script().render_documents(values, release=release)
    return [yaml.safe_load(doc) for doc in docs]


def render(values: dict[str, Any] | None = None, release: str = RELEASE) -> dict[str, Any]:
    """The chart's objects for ``values``, keyed by kind (one object of each kind). The
    PodDisruptionBudgets, one per pod role, are left out: see ``disruption_budgets``."""
    objects = [o for o in render_objects(values, release) if o["kind"] != "PodDisruptionBudget"]
    by_kind = {obj["kind"]: obj for obj in objects}
    assert len(by_kind) == len(objects), f"two objects of one kind: {[o['kind'] for o in objects]}"
    return by_kind


def disruption_budgets(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The chart's PodDisruptionBudgets, keyed by the pod role (component label) each covers."""
    budgets = [o for o in render_objects(values) if o["kind"] == "PodDisruptionBudget"]
    by_role = {b["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: b
               for b in budgets}
    assert len(by_role) == len(budgets), "two PodDisruptionBudgets for one pod role"
    return by_role


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def values_for(case: str) -> dict[str, Any] | None:
    """The values of one of CASES (None: the chart's defaults)."""
    return None if case == "defaults" else example(case)


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


def pod_spec(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]


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
