"""pagedserve's serving layer on Ray Serve: a Router (HTTP + dynamic batcher) and Workers.

``serve run serve_app:app`` serves the default model; ``serve run serve_app:build_app
model=/path num_workers=2 ...`` builds the app from validated arguments (``AppConfig``).
Importing any of it changes nothing outside it: Ray's switches for a cluster that ``serve run``
starts are set when the app is built (``serve_app.cluster.ingress.prepare_cluster_env``).
"""

from typing import Any

from serve_app import import_time  # noqa: F401  (first: the time this process began importing)

__all__ = ["AppConfig", "app", "build_app", "serve_at_normal_priority", "use_fast_ingress"]


def __getattr__(name: str) -> Any:  # lazy: importing serve_app builds nothing
    if name == "build_app":
        from serve_app.app import build_app

        return build_app
    if name == "app":
        from serve_app.app import build_app
        from serve_app.config import AppConfig

        return build_app(AppConfig())
    if name == "AppConfig":
        from serve_app.config import AppConfig

        return AppConfig
    if name in ("use_fast_ingress", "serve_at_normal_priority"):
        from serve_app.cluster import ingress

        return getattr(ingress, name)
    raise AttributeError(name)
