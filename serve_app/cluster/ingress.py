"""The environment of a Ray cluster that this process starts for the app.

Ray reads its switches from the environment of the process that starts a local cluster
(``serve run``, or ``serve.run`` in a script), and its processes inherit that environment. Nothing
here runs at import: ``prepare_cluster_env`` runs when the app is built (``build_app``, which
``serve run serve_app:app`` and ``serve run serve_app:build_app ...`` call before they start the
cluster), and only while Ray is not yet running in this process. HAProxy, Serve's ingress in the
mode set here, then starts through a launcher (``serve_app/cluster/haproxy_launcher.py``) that ties it to
its parent and keeps its statistics page and exporter on 127.0.0.1.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

from serve_app.cluster.haproxy_launcher import BINARY_PATH_VAR, bundled_haproxy, haproxy_launcher
from serve_app.cluster.haproxy_launcher import (
    loopback_admin_binds as loopback_admin_binds,  # re-export
)

logger = logging.getLogger(__name__)


def prepare_cluster_env(environ: MutableMapping[str, str] | None = None) -> None:
    """Ray's switches for the local cluster this process is about to start, unless set.

    Does nothing once Ray runs in this process (a cluster exists; its environment is fixed).
    Serve's defaults in this process were read from the environment as it was: Ray 2.60 makes
    Serve's default HTTP host 0.0.0.0 when it is imported with ``RAY_SERVE_ENABLE_HA_PROXY=1``
    (its multi-node default), so Ray Serve is imported before the switch is set and the HTTP
    port stays on 127.0.0.1.
    """
    import ray
    from ray.serve._private import constants as serve_constants

    if ray.is_initialized():
        return
    environ = os.environ if environ is None else environ
    if serve_constants.DEFAULT_HTTP_HOST not in (None, "127.0.0.1", "localhost"):
        logger.warning("Ray Serve's default HTTP host is %s (RAY_SERVE_ENABLE_HA_PROXY=1 or "
                       "RAY_SERVE_DEFAULT_HTTP_HOST was set before Ray Serve was imported): "
                       "Serve's HTTP port listens beyond this machine",
                       serve_constants.DEFAULT_HTTP_HOST)
    stay_on_loopback(environ)
    use_fast_ingress(environ)
    serve_at_normal_priority(environ)
    pace_background_work(environ)
    use_bound_haproxy(environ)


def local_cluster_cpus() -> float | None:
    """The CPUs of the local Ray cluster that running this app will start, or None.

    ``serve run`` (and ``serve.run`` in a script) start a cluster on this machine when Ray is
    not running in this process and no cluster is found (``RAY_ADDRESS``, or one started here
    with ``ray start``); Ray gives it the machine's cores (its own count, which reads cgroup
    limits). None for any other cluster: its nodes, or its autoscaler, decide what fits.
    """
    import ray
    from ray._private import services, utils

    if ray.is_initialized():
        return None
    try:
        # annotated str (Ray 2.60); None is its documented case: serve run's default address
        if services.canonicalize_bootstrap_address(None) is not None:  # type: ignore[arg-type]
            return None
        return float(utils.get_num_cpus())
    except Exception:  # Ray's private helpers moved: assume nothing about the cluster
        logger.debug("could not tell whether a local cluster will start", exc_info=True)
        return None


def stay_on_loopback(environ: MutableMapping[str, str]) -> None:
    """Keep a local cluster's addresses (GCS, raylet, dashboard, workers) on 127.0.0.1.

    Ray 2.60 on Linux takes the machine's external address as the node's and listens there,
    unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``. Ray reads it when ``ray`` is imported, which
    ``serve run`` does before it imports the app, so the value is also set in Ray's module here
    (``ray/_private/ray_constants.py``, read by ``services.get_node_ip_address``). A value
    already set wins (``=1`` for a node that others must reach).
    """
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in environ:
        return
    environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if environ is os.environ and "ray._private.ray_constants" in sys.modules:
        from ray._private import ray_constants  # already imported: this only names it

        ray_constants.ENABLE_RAY_CLUSTER = False


def use_fast_ingress(environ: MutableMapping[str, str], cpus: int | None = None) -> None:
    """Default a Ray cluster this process starts to Ray Serve's high-throughput ingress.

    HTTP then goes to HAProxy on Serve's port (8000), which forwards to the Router replica's own
    HTTP server ("direct ingress"); replicas talk over gRPC. Through Serve's Python proxy
    instead, every streamed chunk is a message between two Python processes, which on a small
    machine costs a third of the tokens/s (docs/perf/cpu_classes.md). A Router replica that stops
    stays reachable for a while so that load balancers in front can forget it: 30 s by default,
    2 s here, as only HAProxy (told within 0.1 s, and retrying a refused connection elsewhere)
    is in front. HAProxy gets a thread per four CPUs of this machine (1 to 4; Ray's default is
    4): one thread forwards far more than an engine streams, and more threads than that only
    take the cores from the engine on a small machine. Config files set the same variables in
    `controller_options` (deploy/serve_config.yaml), the Helm chart in the pods' environment.
    A value already set wins: RAY_SERVE_ENABLE_HA_PROXY=0 keeps Serve's proxy, which then
    reaches the Router over gRPC (RAY_SERVE_PROXY_USE_GRPC).
    """
    if "RAY_SERVE_ENABLE_HA_PROXY" not in environ and "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in environ:
        environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
        environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    environ.setdefault("RAY_SERVE_HAPROXY_NBTHREAD", str(max(1, min(4, (cpus or 1) // 4))))


def serve_at_normal_priority(environ: MutableMapping[str, str]) -> None:
    """Run the replicas of a Ray cluster this process starts at the normal CPU priority.

    Ray starts its worker processes (every Serve replica, and HAProxy under its manager) at
    niceness 15, so that its own daemons stay responsive. The engine is the latency-critical
    process of an inference service: at niceness 15 any ordinary process on the host (an agent,
    a log shipper, a client) preempts its matmul threads, and one preempted thread of a parallel
    matmul stalls the whole step (docs/perf/cpu_classes.md, "Ray around the engine").
    It is the raylet's setting, so it applies to clusters this process starts (`serve run`);
    clusters started with `ray start` take RAY_worker_niceness from that command's environment
    (the Helm chart sets it). A value already set wins.
    """
    environ.setdefault("RAY_worker_niceness", "0")


PACED = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
}


def pace_background_work(environ: MutableMapping[str, str]) -> None:
    """Slow down two loops of Ray's that take CPU from the engine on a small machine (a cluster
    this process starts; a value already set wins):

    - Serve's control loop, every 0.5 s rather than 0.1 s. Each pass asks the GCS for every
      node's resources and walks every deployment's replicas: in a served run of the 0.5B model
      on 2 cores (64 requests, 42 s) the controller used 1.7-1.9 s and the GCS 1.1-1.2 s at 10
      passes a second, 0.7-0.9 s and 0.6-0.8 s at 2. Serve then acts on a replica's change of
      state and runs the autoscaling policy within 0.5 s; the policy's delays are in seconds.
    - The log monitor (it copies workers' log lines to the driver) globs the log folder every
      0.5 s, not on each of its 10 passes a second (below 1000 files): half its CPU. A new
      worker's first lines reach the driver up to 0.5 s later.

    docs/perf/cpu_classes.md ("What worked") has the measurements.
    """
    for key, value in PACED.items():
        environ.setdefault(key, value)


def use_bound_haproxy(environ: MutableMapping[str, str], directory: Path | None = None) -> None:
    """Have Serve start HAProxy through ``haproxy_launcher`` (Linux, HAProxy mode on).

    ``directory`` holds the launcher (default: ``<cache dir>/bin``). A
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` already set wins, and then HAProxy runs as Ray starts it.
    """
    if (environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1" or not sys.platform.startswith("linux")
            or BINARY_PATH_VAR in environ):
        return
    binary = bundled_haproxy()
    if binary is None:  # Serve will say so when it starts HAProxy
        return
    if directory is None:
        from engine import cache_dir

        directory = cache_dir() / "bin"
    try:
        launcher = haproxy_launcher(binary, directory)
    except OSError as err:  # a read-only cache: a private folder of this process's
        logger.warning("cannot write the HAProxy launcher to %s (%s); using a temporary folder",
                       directory, err)
        launcher = haproxy_launcher(binary, Path(tempfile.mkdtemp(prefix="pagedserve-bin-")))
    environ[BINARY_PATH_VAR] = str(launcher)


def main() -> None:
    """Print, as ``export`` lines, what ``build_app`` would set here, but Serve's mode switches:
    for a cluster that starts before the app is built (``eval "$(python -m serve_app.cluster.ingress)"``,
    then ``serve run deploy/serve_config.yaml``). A process that imports Ray Serve with
    ``RAY_SERVE_ENABLE_HA_PROXY=1`` defaults Serve's HTTP host to 0.0.0.0, so the switches stay
    out of the shell; the config file sets them for Serve's processes (``controller_options``).
    """
    env = dict(os.environ)
    prepare_cluster_env(env)
    for key in sorted(k for k in env if os.environ.get(k) != env[k]):
        if key not in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_THROUGHPUT_OPTIMIZED"):
            print(f"export {key}={shlex.quote(env[key])}")


if __name__ == "__main__":
    main()
