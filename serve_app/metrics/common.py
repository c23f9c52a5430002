"""Prometheus metrics of the serving layer, named after vLLM's, through ``ray.util.metrics``.

Ray's metrics agent on every node serves them on its metrics-export port, with ``ray_`` before
the name. ``serve_app/metrics/names.py`` says what each series is called in the two spellings
(``metrics_naming``: pagedserve's own ``pagedserve_*``, the default, or vLLM's ``vllm_*`` as Ray
Serve LLM exports them) and which labels every series carries (the served model name and
Serve's replica id, besides the labels Ray adds: ``WorkerId``, ...). This module makes each
metric once per process; ``worker`` and ``router`` say what each deployment records.
``deploy/grafana/README.md`` lists every exported series.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ray.util.metrics import Counter, Histogram

from serve_app.metrics.names import Naming

_defined: dict[str, Any] = {}  # one Ray metric object per name and process


def metric(kind: type, naming: Naming, key: str, description: str, extra: tuple[str, ...] = (),
            **kwargs: Any) -> Any:
    name = naming.name(key)
    if name not in _defined:
        _defined[name] = kind(name, description, tag_keys=naming.labels + extra, **kwargs)
    return _defined[name]


def histogram(naming: Naming, key: str, description: str, buckets: Sequence[float]) -> Histogram:
    return cast(Histogram, metric(Histogram, naming, key, description,
                                   boundaries=list(buckets)))


def counter(naming: Naming, key: str, description: str, extra: tuple[str, ...] = ()) -> Counter:
    return cast(Counter, metric(Counter, naming, key, description, extra))


def served_model_name(cfg: Any) -> str:
    """The ``model_name`` label: the name clients use (as vLLM's ``model_name``)."""
    from engine import DEFAULT_MODEL_NAME

    return cfg.served_model_name or cfg.engine.model.model or DEFAULT_MODEL_NAME


def replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id
