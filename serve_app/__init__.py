"""pagedserve's serving layer on Ray Serve: a Router (HTTP + dynamic batcher) and Workers.

``serve run serve_app:app`` serves the default model; ``serve run serve_app:build_app
model=/path num_workers=2 ...`` builds the app from validated arguments (``AppConfig``).
"""

import os
from typing import Any


def use_fast_ingress(environ: Any = os.environ, cpus: int | None = None) -> None:
    """Default a Ray cluster this process starts to Ray Serve's high-throughput ingress.

    Ray Serve reads these when each of its processes starts, from the environment of the process
    that started Ray: `serve run serve_app:app` imports this package before it starts a local
    cluster, so the defaults reach it. HTTP then goes to HAProxy on Serve's port (8000), which
    forwards to the Router replica's own HTTP server ("direct ingress"); replicas talk over gRPC.
    Through Serve's Python proxy instead, every streamed chunk is a message between two Python
    processes, which on a small machine halves the tokens/s (docs/ARCHITECTURE.md, "Ingress").
    A Router replica that stops stays reachable for a while so that load balancers in front can
    forget it: 30 s by default, 2 s here, as only HAProxy (told within 0.1 s, and retrying a
    refused connection elsewhere) is in front. HAProxy gets a thread per four CPUs of this
    machine (1 to 4; Ray's default is 4): one thread forwards far more than an engine streams,
    and more threads than that only take the cores from the engine on a small machine.
    Config files set the same variables in `controller_options` (deploy/serve_config.yaml), the
    Helm chart in the pods' environment. A value already set wins: RAY_SERVE_ENABLE_HA_PROXY=0
    keeps Serve's proxy, which then reaches the Router over gRPC (RAY_SERVE_PROXY_USE_GRPC).
    """
    if "RAY_SERVE_ENABLE_HA_PROXY" not in environ and "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in environ:
        environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
        environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    environ.setdefault("RAY_SERVE_HAPROXY_NBTHREAD", str(max(1, min(4, (cpus or 1) // 4))))


def serve_at_normal_priority(environ: Any = os.environ) -> None:
    """Run the replicas of a Ray cluster this process starts at the normal CPU priority.

    Ray starts its worker processes (every Serve replica, and HAProxy under its manager) at
    niceness 15, so that its own daemons stay responsive. The engine is the latency-critical
    process of an inference service: at niceness 15 any ordinary process on the host (an agent,
    a log shipper, a client) preempts its matmul threads, and one preempted thread of a parallel
    matmul stalls the whole step (docs/ARCHITECTURE.md, "CPU priority", has the measurement).
    It is the raylet's setting, so it applies to clusters this process starts (`serve run`);
    clusters started with `ray start` take RAY_worker_niceness from that command's environment
    (the Helm chart sets it). A value already set wins.
    """
    environ.setdefault("RAY_worker_niceness", "0")


use_fast_ingress()
serve_at_normal_priority()

__all__ = ["AppConfig", "app", "build_app"]


def __getattr__(name: str) -> Any:  # lazy: importing serve_app builds nothing
    if name == "build_app":
        from serve_app.app import build_app

        return build_app
    if name == "app":
        from serve_app.app import build_app

        return build_app({})
    if name == "AppConfig":
        from serve_app.config import AppConfig

        return AppConfig
    raise AttributeError(name)
