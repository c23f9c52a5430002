"""The Router's metrics (batch sizes, time to first token from arrival at the HTTP server,
429s by cause, HTTP statuses by handler), named as ``serve_app/metrics/names.py`` says; the
Worker's are in ``serve_app/metrics/worker.py``."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from serve_app.metrics.common import counter, histogram, replica_id, served_model_name
from serve_app.metrics.names import BATCH_BUCKETS, TTFT_BUCKETS, Naming


class RouterMetrics:
    """One Router replica's metrics: batch sizes, 429s by cause, HTTP statuses."""

    def __init__(self, model_name: str, replica: str, naming: Naming = Naming()) -> None:
        tags = naming.tags(model_name, replica)
        self._batch = histogram(naming, "router_batch_size",
                                 "Requests in each batch the Router sends to a Worker.",
                                 BATCH_BUCKETS).set_default_tags(tags)
        self._ttft = histogram(naming, "time_to_first_token_seconds",
                                "From the request's arrival at the HTTP server to its first "
                                "generated token.", TTFT_BUCKETS).set_default_tags(tags)
        self._rejected = counter(naming, "router_requests_rejected_total",
                                 "HTTP requests the Router answered with 429, by cause.",
                                 ("cause",)).set_default_tags(tags)
        self._http = counter(naming, "http_requests_total",
                             "HTTP responses of the Router, by handler and status code.",
                             ("handler", "status")).set_default_tags(tags)

    @classmethod
    def for_replica(cls, cfg: Any) -> RouterMetrics:
        """This Router replica's metrics."""
        return cls(served_model_name(cfg), replica_id(), Naming(cfg.metrics_naming))

    def first_token(self, seconds: float) -> None:
        """A request's first token reached the Router ``seconds`` after it arrived."""
        self._ttft.observe(seconds)

    def count_batches(self, send: Callable[[Any], Coroutine[Any, Any, None]]
                      ) -> Callable[[Any], Coroutine[Any, Any, None]]:
        """Wrap the batcher's sink so that every batch sent is observed."""
        async def send_counted(batch: Any) -> None:
            self._batch.observe(len(batch.requests))
            await send(batch)

        return send_counted

    def rejected(self, cause: str) -> None:
        self._rejected.inc(1, {"cause": cause})

    def response(self, handler: str, status: int) -> None:
        self._http.inc(1, {"handler": handler, "status": str(status)})


HANDLERS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/stats",
                      "/health", "/tokenize", "/detokenize", "/version"})
MODEL_CARD = "/v1/models/{id}"  # the handler label of every /v1/models/<id>


class HTTPMetricsMiddleware:
    """ASGI middleware counting each response's status by handler (unknown paths: "other")
    into ``metrics``.

    Pure ASGI, so streaming responses pass untouched; the status is read from the response's
    start message. An exception that escapes the app counts as 500.
    """

    def __init__(self, app: Any, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.response(_handler(scope), status)


def _handler(scope: dict[str, Any]) -> str:
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    if path in HANDLERS:
        return path
    return MODEL_CARD if path.startswith("/v1/models/") else "other"


def install_http_metrics(app: Any, metrics: RouterMetrics) -> None:
    """Count the app's responses into ``metrics`` (call once, before the app starts)."""
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
