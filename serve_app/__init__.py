"""pagedserve's serving layer on Ray Serve: a Router (HTTP + dynamic batcher) and Workers.

``serve run serve_app:app`` serves the default model; ``serve run serve_app:build_app
model=/path num_workers=2 ...`` builds the app from validated arguments (``AppConfig``).
"""

import os
from typing import Any


def use_fast_ingress(environ: Any = os.environ) -> None:
    """Default a Ray cluster this process starts to Ray Serve's high-throughput ingress.

    Ray Serve reads these when each of its processes starts, from the environment of the process
    that started Ray: `serve run serve_app:app` imports this package before it starts a local
    cluster, so the defaults reach it. HTTP then goes to HAProxy on Serve's port (8000), which
    forwards to the Router replica's own HTTP server ("direct ingress"); replicas talk over gRPC.
    Through Serve's Python proxy instead, every streamed chunk is a message between two Python
    processes, which on a small machine halves the tokens/s (docs/ARCHITECTURE.md, "Ingress").
    A Router replica that stops stays reachable for a while so that load balancers in front can
    forget it: 30 s by default, 2 s here, as only HAProxy (told within 0.1 s, and retrying a
    refused connection elsewhere) is in front. Config files set the same variables in
    `controller_options` (deploy/serve_config.yaml), the Helm chart in the pods' environment.
    A value already set wins: RAY_SERVE_ENABLE_HA_PROXY=0 keeps Serve's proxy, which then
    reaches the Router over gRPC (RAY_SERVE_PROXY_USE_GRPC).
    """
    if "RAY_SERVE_ENABLE_HA_PROXY" not in environ and "RAY_SERVE_THROUGHPUT_OPTIMIZED" not in environ:
        environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
        environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
    environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")


use_fast_ingress()

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
