"""The Serve pods have PodDisruptionBudgets: a node drain or the cluster autoscaler never evicts
the head (GCS, Serve controller, Router) nor takes the GPU group below its autoscaling floor.

Only an integer ``minAvailable`` works for pods a RayCluster owns: RayCluster has no scale
subresource, so for ``maxUnavailable`` or a percentage the disruption controller cannot count
the expected pods and allows no eviction at all."""

from __future__ import annotations

import pytest

from tests.k8s.chart import CASES, disruption_budgets, example, gpu_group, head, render, values_for

ROLES = {"head": head, "gpu-worker": gpu_group}


@pytest.mark.parametrize("case", CASES)
def test_each_budget_selects_exactly_its_pod_role(case):
    values = values_for(case)
    rs = render(values)["RayService"]
    labels = {role: group(rs)["template"]["metadata"]["labels"] for role, group in ROLES.items()}
    budgets = disruption_budgets(values)
    assert "head" in budgets
    for role, budget in budgets.items():
        assert budget["apiVersion"] == "policy/v1"
        assert budget["metadata"]["name"] == f"pagedserve-{role}"
        selector = budget["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels[role].items()
        other = next(r for r in ROLES if r != role)
        assert not selector.items() <= labels[other].items()
        assert set(budget["spec"]) == {"selector", "minAvailable", "unhealthyPodEvictionPolicy"}
        assert isinstance(budget["spec"]["minAvailable"], int)  # never a percentage
        # A pod that is not Ready (crash-looping, still loading) never blocks a drain.
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.parametrize(("values", "expected"), [
    (None, {"head": 1, "gpu-worker": 1}),                      # 1..4 replicas of 1 GPU
    (example("tp4-pvc.yaml"), {"head": 1, "gpu-worker": 1}),   # 2 replicas: one 8-GPU pod
    ({"tensorParallelSize": 2, "gpuWorkers": {"gpusPerPod": 8, "cpu": 16},
      "autoscaling": {"minReplicas": 5, "maxReplicas": 8}}, {"head": 1, "gpu-worker": 2}),
    (example("scale-to-zero.yaml"), {"head": 1}),              # no floor: nothing to keep
    ({"podDisruptionBudget": {"gpuWorkers": {"minAvailable": 3}}}, {"head": 1, "gpu-worker": 3}),
    ({"podDisruptionBudget": {"head": {"minAvailable": 0}}}, {"gpu-worker": 1}),
    ({"podDisruptionBudget": {"enabled": False}}, {}),
])
def test_gpu_budget_keeps_the_autoscaling_floor(values, expected):
    budgets = disruption_budgets(values)
    assert {role: b["spec"]["minAvailable"] for role, b in budgets.items()} == expected


def test_budgets_are_in_the_plain_manifest():
    from tests.k8s.chart import render_script

    text = render_script().render_manifest()
    assert text.count("kind: PodDisruptionBudget") == 2
