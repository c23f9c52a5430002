"""What of the release answers whom on the network.

- A NodePort or LoadBalancer Serve service (port 8000 reachable from outside the cluster)
  without an API key fails the render, unless ``service.allowUnauthenticated`` says so.
- Every Ray container that may run HAProxy has Serve start it through ``pagedserve-haproxy``,
  which binds HAProxy's statistics page (8404) and Prometheus exporter (9101), on every
  interface in Ray's config, to 127.0.0.1; the image has the command where the chart names it.
- ``networkPolicy.enabled`` renders a NetworkPolicy that the API accepts and that admits, to the
  release's pods, the release's own pods on every port, port 8000 from ``ingressFrom``, the
  dashboard and port 8000 from the KubeRay operator, the metrics port from ``metricsFrom``, and
  nothing else (``network_policy.admits``: the rule the network plugin enforces).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

from tests.k8s.chart import (
    CASES,
    DOCKERFILE,
    ROOT,
    container,
    gpu_group,
    head,
    render,
    values_for,
)
from tests.k8s.network_policy import NETWORK_POLICY_SCHEMA, Source, admits, selects

EXPOSED = ["NodePort", "LoadBalancer"]
LAUNCHER = "/home/ray/anaconda3/bin/pagedserve-haproxy"


# ---- an exposed endpoint needs a key, or the user's word ------------------------------------

@pytest.mark.parametrize("service_type", EXPOSED)
def test_an_exposed_service_without_a_key_fails_the_render(service_type):
    import helm_python as helm

    with pytest.raises(helm.HelmRenderError) as info:
        render({"service": {"type": service_type}})
    message = str(info.value)
    assert f"service.type is {service_type} and apiKey.enabled is false" in message
    assert "Set apiKey.enabled=true" in message
    assert "or service.allowUnauthenticated=true" in message


@pytest.mark.parametrize("service_type", EXPOSED)
@pytest.mark.parametrize("choice", [{"apiKey": {"enabled": True}},
                                    {"service": {"allowUnauthenticated": True}}],
                         ids=["api-key", "opt-in"])
def test_an_exposed_service_renders_with_a_key_or_the_opt_in(service_type, choice):
    values = {**choice, "service": {**choice.get("service", {}), "type": service_type}}
    rs = render(values)["RayService"]
    assert rs["spec"]["serveService"]["spec"]["type"] == service_type


# ---- HAProxy's admin ports on 127.0.0.1 in the pods ------------------------------------------

def env_of(c: dict) -> dict[str, str]:
    """A container's environment as the kubelet builds it: a name set twice takes the last."""
    return {e["name"]: e.get("value") for e in c.get("env") or []}


@pytest.mark.parametrize("case", CASES)
def test_every_ray_container_that_may_run_haproxy_starts_the_launcher(case):
    rs = render(values_for(case))["RayService"]
    for group in (head(rs), gpu_group(rs)):  # Serve runs HAProxy on every node
        env = env_of(container(group))
        assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"  # the chart's default ingress
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == LAUNCHER


def test_the_image_has_the_launcher_where_the_chart_names_it():
    text = DOCKERFILE.read_text()
    assert f'test "$(command -v pagedserve-haproxy)" = {LAUNCHER}' in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^pagedserve-haproxy = "serve_app\.cluster\.haproxy_launcher:main"$', pyproject, re.M)


FAKE_EXEC = """\
import json, os, sys
def execv(path, argv):
    print(json.dumps({"binary": path, "argv": argv,
                      "env": os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")}))
    sys.exit(0)
os.execv = execv
sys.argv = ["pagedserve-haproxy", "-db", "-f", sys.argv[1]]
from serve_app.cluster.haproxy_launcher import main
main()
"""


def ray_haproxy_config(folder) -> str:
    """The HAProxy config Ray 2.60 writes (its statistics page and exporter on every interface),
    in ``folder``; its path."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host="0.0.0.0", port=8000),
                        socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
                        server_state_file=str(folder / "server-state"),
                        metrics_socket_path=str(folder / "metrics.sock"))
    path = str(folder / "haproxy.cfg")
    HAProxyApi(cfg=cfg, config_file_path=path)._generate_config_file_internal()
    return path


def test_the_launcher_binds_the_admin_ports_to_loopback_then_becomes_haproxy(tmp_path,
                                                                             monkeypatch):
    from serve_app.cluster.haproxy_launcher import bundled_haproxy

    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    haproxy = bundled_haproxy()
    if haproxy is None:
        pytest.skip("no HAProxy here (ray-haproxy, or haproxy on the PATH)")
    config = ray_haproxy_config(tmp_path)
    ray_text = open(config).read()
    assert re.search(r"^\s*bind \*:8404$", ray_text, re.M)  # Ray's: every interface
    assert re.search(r"^\s*bind :9101$", ray_text, re.M)
    # As Serve starts it in a pod: the variable names the launcher itself (a separate process:
    # the launcher asks the kernel to kill it with its parent)
    out = subprocess.run([sys.executable, "-c", FAKE_EXEC, config], cwd=ROOT, text=True,
                         capture_output=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT),
                              "RAY_SERVE_HAPROXY_BINARY_PATH": LAUNCHER})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"binary": haproxy, "env": None,
                                      "argv": [haproxy, "-db", "-f", config]}
    text = open(config).read()
    assert re.search(r"^\s*bind 127\.0\.0\.1:8404$", text, re.M)
    assert re.search(r"^\s*bind 127\.0\.0\.1:9101$", text, re.M)
    assert re.search(r"^\s*bind \*:8000$", text, re.M)  # the Serve port as Ray binds it
    assert "mode 666" not in text and "mode 600" in text  # the admin socket, owner only
    check = subprocess.run([haproxy, "-c", "-f", config], capture_output=True, text=True,
                           timeout=60)
    assert check.returncode == 0, check.stderr


# ---- the NetworkPolicy -----------------------------------------------------------------------

PORTS = {"serve": 8000, "dashboard": 8265, "gcs": 6379, "client": 10001, "metrics": 8080,
         "dashboard-agent": 52365, "replica-grpc": 40123}
RESTRICTED = {"ingressFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}},
                               "podSelector": {"matchExpressions": [
                                   {"key": "role", "operator": "In", "values": ["client"]}]}},
                              {"ipBlock": {"cidr": "192.0.2.0/24", "except": ["192.0.2.0/28"]}}],
              "metricsFrom": [{"namespaceSelector": {"matchLabels": {
                  "kubernetes.io/metadata.name": "monitoring"}}}]}


def network_policy(values: dict | None = None, **top) -> tuple[dict, dict]:
    objects = render({"networkPolicy": {"enabled": True, **(values or {})}, **top})
    return objects["NetworkPolicy"], objects["RayService"]


def pod_labels(rs: dict) -> list[dict[str, str]]:
    return [group["template"]["metadata"]["labels"] for group in (head(rs), gpu_group(rs))]


def sources(rs: dict) -> dict[str, Source]:
    peer = pod_labels(rs)[1]
    return {
        "release pod": Source("default", pod_labels=peer),
        "other release": Source("default", pod_labels={**peer, "app.kubernetes.io/instance": "b"}),
        "app client": Source("apps", {"team": "apps"}, {"role": "client"}),
        "app other": Source("apps", {"team": "apps"}, {"role": "batch"}),
        "kuberay operator": Source("kuberay", pod_labels={"app.kubernetes.io/name": "kuberay"}),
        "prometheus": Source("monitoring", pod_labels={"app": "prometheus"}),
        "outside": Source(ip="198.51.100.7"),
        "outside, allowed block": Source(ip="192.0.2.77"),
        "outside, excepted": Source(ip="192.0.2.7"),
    }


def admitted(policy: dict, rs: dict, ports: dict[str, int] = PORTS) -> dict[str, list[str]]:
    """For each source, the ports (by name) it may open on every Ray pod; the pod roles must
    agree."""
    found = {}
    for name, source in sources(rs).items():
        (allowed,) = {tuple(p for p, port in ports.items() if admits(policy, labels, port, source))
                      for labels in pod_labels(rs)}
        found[name] = list(allowed)
    return found


def test_no_network_policy_unless_enabled():
    for case in CASES:
        assert "NetworkPolicy" not in render(values_for(case))


@pytest.mark.parametrize("values", [{}, RESTRICTED], ids=["defaults", "peers"])
def test_network_policy_passes_the_api_schema(values):
    policy, _ = network_policy(values)
    validator = jsonschema.Draft7Validator(NETWORK_POLICY_SCHEMA)
    assert [e.message for e in validator.iter_errors(policy)] == []
    assert policy["metadata"]["name"] == "pagedserve"


def test_network_policy_schema_check_is_strict():
    policy, _ = network_policy()
    policy["spec"]["ingress"][0]["from"] = [{"namespaceSelecter": {}}]
    policy["spec"]["ingress"].append({"ports": [{"port": 8000, "protocol": "HTTP"}]})
    validator = jsonschema.Draft7Validator(NETWORK_POLICY_SCHEMA)
    assert len(list(validator.iter_errors(policy))) == 2


def test_network_policy_isolates_every_ray_pod_of_the_release_only():
    policy, rs = network_policy()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open (weights download)
    for labels in pod_labels(rs):
        assert selects(policy["spec"]["podSelector"], labels)
        assert not selects(policy["spec"]["podSelector"],
                           {**labels, "app.kubernetes.io/instance": "another-release"})


ALL = list(PORTS)


def test_default_network_policy_opens_the_serve_port_and_closes_ray():
    policy, rs = network_policy()
    assert admitted(policy, rs) == {
        "release pod": ALL,                       # Ray between its own pods, on any port
        "other release": ["serve"],
        "app client": ["serve"],                  # ingressFrom [] : any source
        "app other": ["serve"],
        "kuberay operator": ["serve", "dashboard"],
        "prometheus": ["serve"],                  # metricsFrom []: nobody outside the release
        "outside": ["serve"],
        "outside, allowed block": ["serve"],
        "outside, excepted": ["serve"],
    }


def test_network_policy_peers_narrow_the_serve_and_metrics_ports():
    policy, rs = network_policy(RESTRICTED)
    assert admitted(policy, rs) == {
        "release pod": ALL,
        "other release": [],
        "app client": ["serve"],
        "app other": [],
        "kuberay operator": ["serve", "dashboard"],  # it checks each pod's proxy on 8000
        "prometheus": ["metrics"],
        "outside": [],
        "outside, allowed block": ["serve"],
        "outside, excepted": [],
    }


def test_network_policy_follows_the_metrics_port():
    policy, rs = network_policy(RESTRICTED, metrics={"port": 9090})
    ports = {**PORTS, "metrics": 9090, "old metrics": 8080}
    assert admitted(policy, rs, ports)["prometheus"] == ["metrics"]
