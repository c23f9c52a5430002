"""Values that make no sense fail the render (as `helm install` would) with a message that names
the keys: the values schema for single fields, the chart's `fail` checks across fields."""

from __future__ import annotations

import pytest

from tests.k8s.chart import render

SCHEMA = "values don't meet the specifications of the schema"

REJECTED = [
    pytest.param({"tensorParallelSize": 3, "gpuWorkers": {"gpusPerPod": 4}},
                 "tensorParallelSize (3) must divide gpuWorkers.gpusPerPod (4)", id="tp-not-dividing"),
    pytest.param({"tensorParallelSize": 4, "gpuWorkers": {"gpusPerPod": 2}},
                 "tensorParallelSize (4) must divide gpuWorkers.gpusPerPod (2)", id="tp-above-gpus"),
    pytest.param({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
                 "autoscaling: min_replicas (5) is above max_replicas (2)", id="min-above-max"),
    pytest.param({"autoscaling": {"policy": "inline",
                                  "inline": {"min_replicas": 3, "max_replicas": 1}}},
                 "autoscaling: min_replicas (3) is above max_replicas (1)", id="inline-min-above-max"),
    pytest.param({"model": {"source": None}},
                 "at '/model': missing property 'source'", id="no-model-source"),
    pytest.param({"model": {"source": "s3"}},
                 "at '/model/source': value must be one of 'pvc', 'download', 'builtin'",
                 id="unknown-model-source"),
    pytest.param({"model": {"pvc": {"claimName": ""}}},
                 "at '/model/pvc/claimName': minLength: got 0, want 1", id="pvc-without-claim"),
    pytest.param({"model": {"source": "download"}},
                 "at '/model/download/repoId': minLength: got 0, want 1", id="download-without-repo"),
    pytest.param({"model": {"path": "../etc"}}, "at '/model/path'", id="path-escaping-mount"),
    pytest.param({"model": {"source": "download", "download": {
        "repoId": "a/b", "allowPatterns": ["*.json", "*.py"]}}},
                 'model.download.allowPatterns: "*.py" would fetch Python files', id="remote-code"),
    pytest.param({"autoscaling": {"policy": "fastest"}}, "at '/autoscaling/policy'",
                 id="unknown-policy"),
    pytest.param({"app": {"quantization": "int4"}}, "at '/app/quantization'",
                 id="unknown-quantization"),
    pytest.param({"app": {"kv_cache_dtype": "fp8_e5m2"}}, "at '/app/kv_cache_dtype'",
                 id="unknown-kv-cache-dtype"),
    pytest.param({"autoscaling": {"policy": "inline"}},
                 "at '/autoscaling/inline': minProperties: got 0, want 1", id="inline-missing"),
    pytest.param({"autoscaling": {"inline": {"max_replicas": 2}}},
                 'autoscaling.inline is set but autoscaling.policy is "latency_first"',
                 id="inline-unused"),
    pytest.param({"autoscaling": {"policy": "inline", "inline": {"max_replica": 2}}},
                 "additional properties 'max_replica' not allowed", id="inline-typo"),
    pytest.param({"autoscaling": {"minReplicas": -1}},
                 "at '/autoscaling/minReplicas': minimum: got -1, want 0", id="negative-min"),
    pytest.param({"tensorParallelSize": 0}, "at '/tensorParallelSize': minimum: got 0, want 1",
                 id="tp-zero"),
    pytest.param({"gpuWorkers": {"cpu": 1}},
                 "gpuWorkers.cpu (1) is below gpuWorkers.gpusPerPod x app.worker_num_cpus",
                 id="cpus-per-pod"),
    pytest.param({"app": {"model": "/elsewhere"}},
                 "app.model is set by the chart; use model.source and model.path", id="app-model"),
    pytest.param({"app": {"api_key": "plain"}}, "app.api_key is set by the chart; use apiKey",
                 id="plain-api-key"),
    pytest.param({"app": {"dtype": "int4"}}, "at '/app/dtype'", id="bad-dtype"),
    pytest.param({"apiKey": {"enabled": True, "existingSecret": "k", "value": "v"}},
                 "apiKey: set either existingSecret or value, not both", id="two-key-sources"),
    pytest.param({"service": {"type": "ExternalName"}}, "at '/service/type'", id="service-type"),
    # Port 8000 from outside the cluster with no key: the user says so, or sets a key.
    pytest.param({"service": {"type": "LoadBalancer"}},
                 "service.type is LoadBalancer and apiKey.enabled is false", id="open-lb"),
    pytest.param({"service": {"type": "NodePort"}},
                 "service.type is NodePort and apiKey.enabled is false", id="open-nodeport"),
    pytest.param({"service": {"allowUnauthenticated": "yes"}},
                 "at '/service/allowUnauthenticated'", id="opt-in-not-boolean"),
    # NetworkPolicy peers: the API server would refuse the whole policy.
    pytest.param({"networkPolicy": {"ingressFrom": [{"namespaceSelecter": {}}]}},
                 "additional properties 'namespaceSelecter' not allowed", id="peer-typo"),
    pytest.param({"networkPolicy": {"metricsFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                                      "podSelector": {}}]}},
                 "at '/networkPolicy/metricsFrom/0'", id="ip-block-with-selector"),
    pytest.param({"networkPolicy": {"operatorFrom": []}},
                 "at '/networkPolicy/operatorFrom'", id="no-operator-peer"),
    pytest.param({"tensorParalelSize": 2}, "additional properties 'tensorParalelSize' not allowed",
                 id="typo-top-level"),
    # The API server drops unknown securityContext keys silently: a typo would lose a protection.
    pytest.param({"securityContext": {"allowPrivilegeEscalaton": False}},
                 "additional properties 'allowPrivilegeEscalaton' not allowed",
                 id="typo-security-context"),
    pytest.param({"head": {"podSecurityContext": {"runAsNonroot": True}}},
                 "additional properties 'runAsNonroot' not allowed", id="typo-pod-security-context"),
    pytest.param({"podSecurityContext": {"seccompProfile": {"type": "Unconfind"}}},
                 "at '/podSecurityContext/seccompProfile/type'", id="bad-seccomp-type"),
    pytest.param({"gpuWorkers": {"volumes": [{"name": "model", "emptyDir": {}}]}},
                 'gpuWorkers.volumes: "model" is a volume the chart makes', id="volume-name-taken"),
    pytest.param({"head": {"volumeMounts": [{"name": "cache", "mountPath": "/dev/shm"}]}},
                 'head.volumeMounts: "/dev/shm" is where the chart mounts', id="mount-path-taken"),
    pytest.param({"head": {"containerEnv": [{"value": "1"}]}},
                 "at '/head/containerEnv/0': missing property 'name'", id="env-without-name"),
    pytest.param({"gpuWorkers": {"serviceAccount": "sa"}},
                 "additional properties 'serviceAccount' not allowed", id="typo-service-account"),
    # RayCluster has no scale subresource: with maxUnavailable or a percentage the disruption
    # controller could not count the pods and would block every eviction.
    pytest.param({"podDisruptionBudget": {"gpuWorkers": {"maxUnavailable": 1}}},
                 "additional properties 'maxUnavailable' not allowed", id="pdb-max-unavailable"),
    pytest.param({"podDisruptionBudget": {"head": {"minAvailable": "50%"}}},
                 "at '/podDisruptionBudget/head/minAvailable'", id="pdb-percentage"),
]


@pytest.mark.parametrize(("values", "message"), REJECTED)
def test_render_fails_with_a_clear_message(values, message):
    import helm_python as helm

    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as info:
        render(values)
    assert message in str(info.value)
    if isinstance(info.value, helm.HelmValuesError):
        assert SCHEMA in str(info.value)
