"""The Helm chart renders, for its defaults and every example values file, a RayService that
KubeRay's CRD accepts, whose Serve config Ray accepts and whose app args this app accepts; the
GPU group follows the tensor-parallel size and the Worker bounds; only the Serve port leaves the
cluster."""

from __future__ import annotations

import base64
import importlib

import pytest
import yaml

from serve_app.config import AppConfig
from tests.k8s.chart import (
    CASES,
    CHART,
    ROOT,
    app_args,
    container,
    example,
    gpu_group,
    head,
    render,
    serve_config,
    values_for,
)

# Fields the chart sets that AppConfig gains in parallel issues (autoscaling policies, the API
# key read from a mounted Secret). Until it has them, the args are checked without them and
# test_app_config_knows_chart_fields reports the gap as a skip.
CHART_FIELDS = ("autoscaling", "api_key_file")


def validate_app_args(args: dict) -> AppConfig:
    pending = [k for k in CHART_FIELDS if k not in AppConfig.model_fields]
    return AppConfig.model_validate({k: v for k, v in args.items() if k not in pending})


def test_examples_exist():
    assert {"tp1-download.yaml", "tp4-pvc.yaml", "scale-to-zero.yaml"} <= set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_rayservice_matches_kuberay_crd(case, crd_validator):
    rs = render(values_for(case))["RayService"]
    errors = sorted(crd_validator.iter_errors(rs), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                                 for e in errors)
    assert rs["apiVersion"] == "ray.io/v1"
    name = rs["metadata"]["name"]
    assert len(name) <= 40 and name.replace("-", "").isalnum() and name[0].isalpha()


def test_crd_check_rejects_unknown_fields(crd_validator):
    rs = render()["RayService"]
    gpu_group(rs)["minReplica"] = 1  # a typo the API server would silently drop
    (error,) = crd_validator.iter_errors(rs)
    assert "'minReplica' was unexpected" in error.message


@pytest.mark.parametrize("case", CASES)
def test_serve_config_is_this_app(case):
    from ray.serve.schema import ServeDeploySchema

    rs = render(values_for(case))["RayService"]
    schema = ServeDeploySchema.model_validate(serve_config(rs))
    (app,) = schema.applications
    module, attr = app.import_path.split(":")
    assert callable(getattr(importlib.import_module(module), attr))  # imports this app
    assert app.route_prefix == "/"
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    cfg = validate_app_args(app.args)
    values = values_for(case) or {}
    assert cfg.engine.parallel.tensor_parallel_size == values.get("tensorParallelSize", 1)
    assert cfg.accelerator == "gpu"  # never 'auto': with no GPU node yet it would pick the CPU
    assert cfg.api_key is None  # a key never sits in the RayService


@pytest.mark.parametrize("field", CHART_FIELDS)
def test_app_config_knows_chart_fields(field):
    if field not in AppConfig.model_fields:
        pytest.skip(f"AppConfig has no {field!r} field yet; the chart's args carry it")


@pytest.mark.parametrize("case", CASES)
def test_chart_lints_clean(case):
    import helm_python as helm

    report = helm.lint(CHART, values_for(case), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], report


# ---- the GPU worker group ------------------------------------------------------------------

@pytest.mark.parametrize(("values", "gpus", "pods", "bounds"), [
    (None, 1, (1, 4), (1, 4)),                                  # defaults: TP 1, 1..4 replicas
    (example("tp4-pvc.yaml"), 8, (1, 4), (2, 8)),               # 2 replicas of 4 GPUs per pod
    (example("inline-policy.yaml"), 2, (1, 3), (1, 3)),         # bounds from the inline policy
    (example("scale-to-zero.yaml"), 1, (0, 2), (0, 2)),
    ({"tensorParallelSize": 2, "gpuWorkers": {"gpusPerPod": 8, "cpu": 16},
      "autoscaling": {"minReplicas": 1, "maxReplicas": 5}}, 8, (1, 2), (1, 5)),  # ceil(5 / 4)
])
def test_gpu_group_fits_tp_and_follows_worker_bounds(values, gpus, pods, bounds):
    rs = render(values)["RayService"]
    group = gpu_group(rs)
    assert (group["minReplicas"], group["maxReplicas"]) == pods
    assert group["replicas"] == pods[0]
    res = container(group)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == str(gpus)
    assert group["rayStartParams"]["num-gpus"] == str(gpus)
    args = app_args(rs)
    if isinstance(args["autoscaling"], dict):  # inline: Serve's bounds are the pods' bounds
        assert (args["autoscaling"]["min_replicas"], args["autoscaling"]["max_replicas"]) == bounds


def test_inline_policy_without_bounds_takes_them_from_values():
    rs = render({"autoscaling": {"policy": "inline", "minReplicas": 2, "maxReplicas": 6,
                                 "inline": {"target_queue_per_replica": 8}}})["RayService"]
    assert app_args(rs)["autoscaling"] == {"min_replicas": 2, "max_replicas": 6,
                                           "target_queue_per_replica": 8}
    assert (gpu_group(rs)["minReplicas"], gpu_group(rs)["maxReplicas"]) == (2, 6)


def test_named_policy_passes_through():
    rs = render({"autoscaling": {"policy": "throughput_first"}})["RayService"]
    assert app_args(rs)["autoscaling"] == "throughput_first"
    rs = render({"autoscaling": {"policy": "/etc/pagedserve/policy.yaml"}})["RayService"]
    assert app_args(rs)["autoscaling"] == "/etc/pagedserve/policy.yaml"


def test_head_does_no_gpu_work_and_autoscaler_is_on():
    rs = render()["RayService"]
    h = head(rs)
    assert h["rayStartParams"]["num-gpus"] == "0"
    resources = container(h)["resources"]
    assert not any("gpu" in k for part in resources.values() for k in part)
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["idleTimeoutSeconds"] == 300
    assert cluster["rayVersion"] == yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]


# ---- model weights -------------------------------------------------------------------------

def volumes(group: dict) -> dict[str, dict]:
    return {v["name"]: v for v in group["template"]["spec"].get("volumes", [])}


def test_weights_from_a_pvc_are_mounted_read_only():
    rs = render(example("tp4-pvc.yaml"))["RayService"]
    group = gpu_group(rs)
    assert volumes(group)["model"]["persistentVolumeClaim"] == {"claimName": "llm-weights",
                                                                 "readOnly": True}
    mounts = {m["name"]: m for m in container(group)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert app_args(rs)["model"] == "/models/Llama-3.1-70B-Instruct"
    assert app_args(rs)["served_model_name"] == "llama-3.1-70b"
    assert "initContainers" not in group["template"]["spec"]
    assert "model" not in volumes(head(rs))  # the Router gets its tokenizer from a Worker


def test_weights_fetched_by_an_init_container_never_include_code():
    rs = render(example("tp1-download.yaml"))["RayService"]
    spec = gpu_group(rs)["template"]["spec"]
    (init,) = spec["initContainers"]
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["MODEL_DIR"] == app_args(rs)["model"] == "/models/Qwen2.5-7B-Instruct"
    assert env["HF_REPO_ID"] == "Qwen/Qwen2.5-7B-Instruct"
    patterns = env["ALLOW_PATTERNS"].split(",")
    assert "*.safetensors" in patterns
    assert not any(p.endswith(".py") or p.endswith(".bin") or p == "*" for p in patterns)
    assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
    assert volumes(gpu_group(rs))["model"] == {"name": "model", "emptyDir": {"sizeLimit": "32Gi"}}
    assert "HF_TOKEN" not in env


def test_download_token_and_custom_command():
    rs = render({"model": {"source": "download", "download": {
        "tokenSecret": "hf", "command": ["sh", "-c", "s5cmd cp 's3://b/m/*' $MODEL_DIR"]}}})
    (init,) = gpu_group(rs["RayService"])["template"]["spec"]["initContainers"]
    assert init["command"] == ["sh", "-c", "s5cmd cp 's3://b/m/*' $MODEL_DIR"]
    (token,) = [e for e in init["env"] if e["name"] == "HF_TOKEN"]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "HF_TOKEN"}


def test_builtin_model_needs_no_volume():
    rs = render(example("smoke.yaml"))["RayService"]
    assert "model" not in app_args(rs)  # None: the small default model
    assert "model" not in volumes(gpu_group(rs))


# ---- exposure, API key, metrics ------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_only_the_serve_port_leaves_the_cluster(case):
    objects = render(values_for(case))
    assert not {"Service", "Ingress", "Route", "Gateway", "HTTPRoute"} & set(objects)
    rs = objects["RayService"]
    serve_svc = rs["spec"]["serveService"]["spec"]
    assert serve_svc["ports"] == [{"name": "serve", "port": 8000, "targetPort": 8000,
                                   "protocol": "TCP"}]
    h = head(rs)
    assert h["serviceType"] == "ClusterIP"  # dashboard, job API, GCS, client: internal only
    assert not h.get("enableIngress") and "headService" not in h


def test_load_balancer_exposes_the_serve_port_only():
    rs = render(example("api-key.yaml"))["RayService"]
    assert rs["spec"]["serveService"]["spec"]["type"] == "LoadBalancer"
    assert [p["port"] for p in rs["spec"]["serveService"]["spec"]["ports"]] == [8000]
    assert head(rs)["serviceType"] == "ClusterIP"


def api_key_mounts(rs: dict) -> list[dict]:
    found = []
    for group in (head(rs), gpu_group(rs)):
        (vol,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "api-key"]
        (mount,) = [m for m in container(group)["volumeMounts"] if m["name"] == "api-key"]
        found.append((vol["secret"], mount))
    return found


def test_api_key_from_an_existing_secret():
    objects = render(example("api-key.yaml"))
    assert "Secret" not in objects
    rs = objects["RayService"]
    for secret, mount in api_key_mounts(rs):  # the Router may run on any Ray pod
        assert secret["secretName"] == "pagedserve-api-key"
        assert secret["items"] == [{"key": "api-key", "path": "api-key"}]
        assert mount["readOnly"] is True
        assert app_args(rs)["api_key_file"] == mount["mountPath"] + "/api-key"
    assert "api_key" not in app_args(rs)


def test_api_key_secret_created_by_the_chart():
    objects = render({"apiKey": {"enabled": True, "value": "s3cret"}})
    secret = objects["Secret"]
    assert secret["metadata"]["name"] == "pagedserve-api-key"
    assert base64.b64decode(secret["data"]["api-key"]) == b"s3cret"
    generated = render({"apiKey": {"enabled": True}})["Secret"]
    assert len(base64.b64decode(generated["data"]["api-key"])) == 48
    assert "Secret" not in render()


def test_metrics_scrape_annotations_and_pod_monitor():
    objects = render(example("api-key.yaml"))
    rs = objects["RayService"]
    for group in (head(rs), gpu_group(rs)):
        meta = group["template"]["metadata"]
        assert meta["annotations"]["prometheus.io/scrape"] == "true"
        assert meta["annotations"]["prometheus.io/port"] == "8080"
        assert {"name": "metrics", "containerPort": 8080} in container(group)["ports"]
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
    monitor = objects["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    pod_labels = head(rs)["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "PodMonitor" not in render()



def bundled_policy(case: str) -> str | None:
    policy = ((values_for(case) or {}).get("autoscaling") or {}).get("policy", "latency_first")
    return None if policy == "inline" or policy.startswith("/") else policy


@pytest.mark.parametrize("case", [c for c in CASES if bundled_policy(c)])
def test_named_policy_bounds_match_the_bundled_policy(case):
    """With a bundled policy, Serve takes the Worker bounds from the policy file in the image
    and the GPU group takes them from the values: they must be the same numbers."""
    path = ROOT / "deploy" / "autoscaling" / f"{bundled_policy(case)}.yaml"
    if not path.is_file():
        pytest.skip(f"{path.relative_to(ROOT)} is not in this checkout yet")
    import helm_python as helm

    bundled = yaml.safe_load(path.read_text())
    with helm.Chart.load(CHART) as chart:
        autoscaling = chart.merge_values(values_for(case))["autoscaling"]
    bounds = (autoscaling["minReplicas"], autoscaling["maxReplicas"])
    assert bounds == (bundled["min_replicas"], bundled["max_replicas"]), (
        f"{case}: autoscaling.minReplicas/maxReplicas {bounds} differ from {path.name}")


@pytest.mark.parametrize("ingress, env", [
    ("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                 "RAY_SERVE_HAPROXY_BINARY_PATH": "/home/ray/anaconda3/bin/pagedserve-haproxy"}),
    ("proxy", {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_PROXY_USE_GRPC": "1"}),
])
def test_ingress_mode_reaches_every_ray_container(ingress, env):
    rs = render({"ingress": ingress})["RayService"]
    for group in (head(rs), gpu_group(rs)):
        assert {e["name"]: e["value"] for e in container(group)["env"]} == {
            **env, "RAY_worker_niceness": "0"}
    assert render(None)["RayService"] == render({"ingress": "haproxy"})["RayService"]
