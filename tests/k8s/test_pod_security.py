"""Every pod the chart makes meets the "restricted" Pod Security Standard (which includes
"baseline"), so the chart installs in a namespace labelled
``pod-security.kubernetes.io/enforce: restricted``; the pods run as the Ray image's user.

``restricted_violations`` is the standard's rules as the Kubernetes docs state them ("Pod Security
Standards", v1.30), checked on each pod template as KubeRay completes it: the head pod gains the
autoscaler sidecar (its securityContext is ``autoscalerOptions.securityContext``), each GPU pod
the ``wait-gcs-ready`` init container (a copy of the Ray container's securityContext).
"""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.k8s.chart import (
    CASES,
    CHART,
    DOCKERFILE,
    container,
    example,
    gpu_group,
    head,
    pod_spec,
    render,
    values_for,
)

# Baseline lets a container add a short list of capabilities; restricted narrows it to one.
ADDABLE_CAPABILITIES = {"NET_BIND_SERVICE"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
CONFINED = {"RuntimeDefault", "Localhost"}


def restricted_violations(pod: dict) -> list[str]:
    """What keeps ``pod`` (a Pod or pod template: ``metadata`` and ``spec``) out of a restricted
    namespace, one line per broken rule; [] when it is admitted. A container's own
    securityContext field wins over the pod's, as in the kubelet."""
    spec, found = pod["spec"], []
    psc = spec.get("securityContext") or {}
    found += [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    for vol in spec.get("volumes") or []:
        (kind,) = set(vol) - {"name"}
        if kind not in RESTRICTED_VOLUMES:
            found.append(f"volume {vol['name']}: {kind}")
    found += [f"sysctl {s['name']}" for s in psc.get("sysctls") or []
              if s["name"] not in SAFE_SYSCTLS]
    found += [f"pod {problem}" for problem in _context_violations(psc)]
    for key, value in ((pod.get("metadata") or {}).get("annotations") or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (
                value == "runtime/default" or value.startswith("localhost/")):
            found.append(f"{key}: {value}")
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            found += [f"{c['name']}: {p}" for p in _container_violations(c, psc)]
    return found


def _context_violations(ctx: dict) -> list[str]:
    """Rules a pod's and a container's securityContext share."""
    found = []
    if (ctx.get("windowsOptions") or {}).get("hostProcess"):
        found.append("windowsOptions.hostProcess")
    selinux = ctx.get("seLinuxOptions") or {}
    if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
        found.append(f"seLinuxOptions {selinux}")
    if "appArmorProfile" in ctx and ctx["appArmorProfile"].get("type") not in CONFINED:
        found.append(f"appArmorProfile {ctx['appArmorProfile'].get('type')}")
    if "seccompProfile" in ctx and ctx["seccompProfile"].get("type") not in CONFINED:
        found.append(f"seccompProfile {ctx['seccompProfile'].get('type')}")
    if ctx.get("runAsUser") == 0:
        found.append("runAsUser 0")
    if ctx.get("runAsNonRoot") is False:
        found.append("runAsNonRoot false")
    return found


def _container_violations(c: dict, psc: dict) -> list[str]:
    ctx = c.get("securityContext") or {}
    found = _context_violations(ctx)
    if ctx.get("privileged"):
        found.append("privileged")
    if ctx.get("procMount", "Default") != "Default":
        found.append(f"procMount {ctx['procMount']}")
    if ctx.get("allowPrivilegeEscalation") is not False:
        found.append("allowPrivilegeEscalation not false")
    caps = ctx.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        found.append("capabilities.drop lacks ALL")
    found += [f"capabilities.add {cap}" for cap in caps.get("add") or []
              if cap not in ADDABLE_CAPABILITIES]
    found += [f"hostPort {p['hostPort']}" for p in c.get("ports") or [] if p.get("hostPort")]
    if ctx.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
        found.append("runAsNonRoot not true (pod or container)")
    seccomp = ctx.get("seccompProfile", psc.get("seccompProfile")) or {}
    if seccomp.get("type") not in CONFINED:
        found.append("seccompProfile not RuntimeDefault or Localhost (pod or container)")
    return found


def kuberay_pods(rs: dict) -> dict[str, dict]:
    """The RayService's pod templates with the containers KubeRay adds to them."""
    h, g = copy.deepcopy(head(rs)["template"]), copy.deepcopy(gpu_group(rs)["template"])
    cluster = rs["spec"]["rayClusterConfig"]
    if cluster.get("enableInTreeAutoscaling"):
        options = cluster.get("autoscalerOptions") or {}
        h["spec"]["containers"].append({"name": "autoscaler", "image": container(head(rs))["image"],
                                        "securityContext": options.get("securityContext")})
    ray = g["spec"]["containers"][0]
    g["spec"]["initContainers"] = [{"name": "wait-gcs-ready", "image": ray["image"],
                                    "securityContext": copy.deepcopy(ray.get("securityContext"))},
                                   *g["spec"].get("initContainers", [])]
    return {"head": h, "gpu-worker": g}


def violations(values: dict | None) -> list[str]:
    pods = kuberay_pods(render(values)["RayService"])
    return [f"{role}: {v}" for role, pod in pods.items() for v in restricted_violations(pod)]


@pytest.mark.parametrize("case", CASES)
def test_pods_meet_the_restricted_pod_security_standard(case):
    assert violations(values_for(case)) == []


# Each is something a values file can set; the checker must name it.
BREACHES = [
    pytest.param({"podSecurityContext": {"runAsUser": 0}},
                 ["head: pod runAsUser 0", "gpu-worker: pod runAsUser 0"], id="root-uid"),
    pytest.param({"podSecurityContext": {"runAsNonRoot": False}},
                 ["head: pod runAsNonRoot false",
                  "head: ray-head: runAsNonRoot not true (pod or container)"],
                 id="run-as-root-allowed"),
    pytest.param({"head": {"securityContext": {"privileged": True}}},
                 ["head: ray-head: privileged"], id="privileged"),
    pytest.param({"gpuWorkers": {"securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}},
                 ["gpu-worker: ray-worker: capabilities.drop lacks ALL",
                  "gpu-worker: ray-worker: capabilities.add IPC_LOCK",
                  "gpu-worker: wait-gcs-ready: capabilities.add IPC_LOCK"], id="capability"),
    pytest.param({"gpuWorkers": {"volumes": [{"name": "cache", "hostPath": {"path": "/mnt"}}],
                                 "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}},
                 ["gpu-worker: volume cache: hostPath"], id="host-path"),
    pytest.param({"rayAutoscaler": {"securityContext": {"allowPrivilegeEscalation": True}}},
                 ["head: autoscaler: allowPrivilegeEscalation not false"], id="autoscaler"),
    pytest.param({"podSecurityContext": {"seccompProfile": {"type": "Unconfined"}}},
                 ["head: pod seccompProfile Unconfined",
                  "head: ray-head: seccompProfile not RuntimeDefault or Localhost (pod or "
                  "container)"], id="seccomp-unconfined"),
    pytest.param({"model": {"source": "download", "download": {
        "repoId": "a/b", "securityContext": {"runAsUser": 0}}}},
                 ["gpu-worker: fetch-model: runAsUser 0"], id="download-as-root"),
    pytest.param({"head": {"podSecurityContext": {"sysctls": [
        {"name": "kernel.msgmax", "value": "65536"}]}}},
                 ["head: sysctl kernel.msgmax"], id="unsafe-sysctl"),
    pytest.param({"gpuWorkers": {"podAnnotations": {
        APPARMOR_ANNOTATION + "ray-worker": "unconfined"}}},
                 [f"gpu-worker: {APPARMOR_ANNOTATION}ray-worker: unconfined"], id="apparmor"),
    pytest.param({"podSecurityContext": None, "securityContext": None},
                 ["head: ray-head: allowPrivilegeEscalation not false",
                  "head: ray-head: runAsNonRoot not true (pod or container)",
                  "gpu-worker: ray-worker: capabilities.drop lacks ALL"], id="defaults-removed"),
]


@pytest.mark.parametrize(("values", "expected"), BREACHES)
def test_checker_names_each_breach(values, expected):
    found = violations(values)
    missing = [e for e in expected if e not in found]
    assert not missing, f"not reported: {missing}; reported: {found}"


def test_checker_covers_what_values_cannot_set():
    """Host namespaces, host ports, /proc mounts and SELinux escapes, on a doctored pod."""
    pod = kuberay_pods(render()["RayService"])["gpu-worker"]
    assert restricted_violations(pod) == []
    spec = pod["spec"]
    spec["hostNetwork"] = True
    ray = spec["containers"][0]
    ray["ports"].append({"containerPort": 9000, "hostPort": 9000})
    ray["securityContext"].update(procMount="Unmasked", seLinuxOptions={"type": "spc_t"})
    assert restricted_violations(pod) == [
        "hostNetwork: true", "ray-worker: seLinuxOptions {'type': 'spc_t'}",
        "ray-worker: procMount Unmasked", "ray-worker: hostPort 9000"]


# ---- the user the pods run as ----------------------------------------------------------------

def test_pods_run_as_the_ray_image_user():
    """rayproject/ray images run as `ray` (uid 1000, group `users`, gid 100); weights volumes
    get gid 100, so an init container's download is readable by the Ray container."""
    rs = render(example("tp1-download.yaml"))["RayService"]
    for group in (head(rs), gpu_group(rs)):
        ctx = pod_spec(group)["securityContext"]
        assert ctx == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100,
                       "fsGroup": 100, "fsGroupChangePolicy": "OnRootMismatch",
                       "seccompProfile": {"type": "RuntimeDefault"}}
        assert container(group)["securityContext"] == {
            "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    (fetch,) = pod_spec(gpu_group(rs))["initContainers"]
    assert fetch["securityContext"] == container(gpu_group(rs))["securityContext"]
    env = {e["name"]: e["value"] for e in fetch["env"] if "value" in e}
    assert env["HF_HOME"].startswith("/tmp/")  # writable by any uid; the model dir is an emptyDir
    autoscaler = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert autoscaler == container(head(rs))["securityContext"]


def test_image_user_matches_the_chart():
    text = DOCKERFILE.read_text()
    assert "\nUSER " not in text  # the base image's USER 1000 (ray) stays in force
    assert "FROM rayproject/ray:" in text and "--chown=ray:users" in text
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pod = values["podSecurityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (1000, 100, 100)


def test_security_contexts_are_overridable_per_pod_role():
    """The top-level contexts apply to every pod and container; a role's own keys replace
    the same top-level keys, the others stay."""
    rs = render({"podSecurityContext": {"runAsUser": 2000, "fsGroup": 3000},
                 "head": {"securityContext": {"readOnlyRootFilesystem": True}},
                 "gpuWorkers": {"podSecurityContext": {"runAsUser": 4000, "fsGroup": None}},
                 "rayAutoscaler": {"securityContext": {"runAsUser": 5000}}})["RayService"]
    head_pod = pod_spec(head(rs))["securityContext"]
    gpu_pod = pod_spec(gpu_group(rs))["securityContext"]
    assert (head_pod["runAsUser"], head_pod["fsGroup"], head_pod["runAsGroup"]) == (2000, 3000, 100)
    assert gpu_pod["runAsUser"] == 4000 and "fsGroup" not in gpu_pod  # null: dropped here only
    assert container(head(rs))["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True}
    assert "readOnlyRootFilesystem" not in container(gpu_group(rs))["securityContext"]
    autoscaler = rs["spec"]["rayClusterConfig"]["autoscalerOptions"]["securityContext"]
    assert autoscaler["runAsUser"] == 5000 and autoscaler["allowPrivilegeEscalation"] is False
