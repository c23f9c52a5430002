"""Live Worker request routers in this process, by deployment name.

Serve pickles a custom request router's module *by value*, so state the Router must share with
its handle's ``WorkerRequestRouter`` lives here, in a module pickled by reference. The Router
reads the running Worker replica ids from it to aggregate stats and check health, and their
last routing stats for admission.
"""

from __future__ import annotations

import threading
from typing import Any

_LIVE: dict[str, Any] = {}
_LOCK = threading.Lock()


def register(deployment: str, router: Any) -> None:
    with _LOCK:
        _LIVE[deployment] = router


def known_replicas(deployment: str = "Worker") -> list[str]:
    """Unique ids of the running replicas this process's handle routes to (may be empty)."""
    with _LOCK:
        router = _LIVE.get(deployment)
    if router is None:
        return []
    return [rid.unique_id for rid in list(router.curr_replicas)]


def routing_stats(deployment: str = "Worker") -> list[dict[str, Any]]:
    """The last ``record_routing_stats`` of each running replica (empty before its first)."""
    with _LOCK:
        router = _LIVE.get(deployment)
    if router is None:
        return []
    return [dict(r.routing_stats or {}) for r in list(router.curr_replicas.values())]
