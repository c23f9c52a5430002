"""What users add to a KubeRay chart's pods reaches the head or the GPU pods, under the names
KubeRay's ray-cluster chart uses (containerEnv, envFrom, volumes, volumeMounts, serviceAccountName,
runtimeClassName, ...), and the result is still a RayService KubeRay's CRD accepts."""

from __future__ import annotations

import pytest

from tests.k8s.chart import container, gpu_group, head, pod_spec, render

ROLES = {"head": head, "gpuWorkers": gpu_group}


def options(role: str) -> dict:
    """One of each pod option, named after the role so the test can tell where each went."""
    return {
        "containerEnv": [{"name": "HTTPS_PROXY", "value": f"http://proxy-{role}:3128"},
                         {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "envFrom": [{"secretRef": {"name": f"{role}-env"}}],
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}},
                    {"name": "ca", "configMap": {"name": f"{role}-ca"}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"},
                         {"name": "ca", "mountPath": "/etc/ssl/private-ca", "readOnly": True}],
        "serviceAccountName": f"{role.lower()}-sa",
        "priorityClassName": f"{role.lower()}-priority",
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "nodeSelector": {"pool": role},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": role,
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "pool", "operator": "In", "values": [role]}]}]}}},
        "podAnnotations": {"example.com/owner": role},
        "podLabels": {"team": role.lower()},
    }


@pytest.fixture(scope="module")
def with_options():
    return render({role: options(role) for role in ROLES})["RayService"]


@pytest.mark.parametrize("role", ROLES)
def test_pod_options_reach_their_pods(role, with_options):
    group, opts = ROLES[role](with_options), options(role)
    spec, ray = pod_spec(group), container(group)
    for key in ("serviceAccountName", "priorityClassName", "runtimeClassName",
                "topologySpreadConstraints", "nodeSelector", "affinity"):
        assert spec[key] == opts[key], key
    assert opts["tolerations"][0] in spec["tolerations"]
    assert ray["env"][-2:] == opts["containerEnv"]  # after the chart's own: they win
    assert ray["env"][0] == {"name": "RAY_worker_niceness", "value": "0"}
    assert ray["envFrom"] == opts["envFrom"]
    assert spec["volumes"][-2:] == opts["volumes"] and spec["volumes"][0]["name"] == "dshm"
    assert ray["volumeMounts"][-2:] == opts["volumeMounts"]
    meta = group["template"]["metadata"]
    assert meta["annotations"]["example.com/owner"] == role
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert meta["labels"]["team"] == role.lower()


def test_pod_options_pass_the_kuberay_crd(with_options, crd_validator):
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in crd_validator.iter_errors(with_options)]
    assert not errors, errors


def test_no_pod_options_no_keys():
    rs = render()["RayService"]
    for group in (head(rs), gpu_group(rs)):
        assert not {"serviceAccountName", "priorityClassName", "runtimeClassName",
                    "topologySpreadConstraints"} & set(pod_spec(group))
        assert "envFrom" not in container(group)


def test_download_runs_with_the_gpu_pods_service_account():
    """A workload identity (IRSA, GKE) bound to gpuWorkers.serviceAccountName also reaches the
    weights download, which runs in the GPU pod."""
    rs = render({"model": {"source": "download", "download": {"repoId": "a/b"}},
                 "gpuWorkers": {"serviceAccountName": "weights-reader"}})["RayService"]
    spec = pod_spec(gpu_group(rs))
    assert spec["serviceAccountName"] == "weights-reader"
    assert [c["name"] for c in spec["initContainers"]] == ["fetch-model"]
