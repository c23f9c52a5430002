"""Prometheus metrics of the serving layer, named after vLLM's, through ``ray.util.metrics``.

Ray's metrics agent on every node serves them on its metrics-export port, with ``ray_`` before
the name: ``pagedserve_num_requests_running`` here is ``ray_pagedserve_num_requests_running`` in
Prometheus, the counterpart of vLLM's ``vllm:num_requests_running``. Ray no longer accepts ':' in
names, so the prefix is ``pagedserve_``; counters end in ``_total`` as vLLM's exported counters
do. Every series carries ``model_name`` (the served name) and ``replica`` (Serve's replica id, as
in Serve's own ``ray_serve_*`` metrics), besides the labels Ray adds (``WorkerId``, ...).

The engine stays free of Ray: it puts per-request timings on its final ``RequestOutput.metrics``
and keeps per-step records and counters (``AsyncEngine.pop_step_records``, ``get_stats``). A
Worker reads them here: request metrics as each request ends (``WorkerMetrics.track``), gauges,
counters and step histograms once a second (``FLUSH_INTERVAL_S``), ``model_info`` once. Nothing
runs per token but one float appended per streamed output for the inter-token latency.

``deploy/grafana/README.md`` lists every exported series.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any, Literal, Protocol, cast

from ray.util.metrics import Counter, Gauge, Histogram

from engine.outputs import RequestOutput
from engine.stats import EngineStats

logger = logging.getLogger("ray.serve")

PREFIX = "pagedserve_"
EXPORT_PREFIX = "ray_"  # what Ray's exporter puts before every name
FLUSH_INTERVAL_S = 1.0
LABELS = ("model_name", "replica")

# Histogram buckets, in seconds unless named otherwise.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0]
QUEUE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 80.0, 160.0, 320.0, 640.0]
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]

GaugeStat = Literal["num_running", "num_waiting", "kv_cache_usage"]
CounterStat = Literal["prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries",
                      "prefix_cache_hits", "num_preemptions"]

# engine.get_stats() gauges -> (the metric set to each, its description)
_ENGINE_GAUGES: dict[GaugeStat, tuple[str, str]] = {
    "num_running": ("num_requests_running", "Sequences in the engine's running batch."),
    "num_waiting": ("num_requests_waiting",
                    "Sequences waiting to be scheduled (preempted ones included)."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)."),
}
# engine.get_stats() counters -> (the metric each one's increase is added to, its description)
_ENGINE_COUNTERS: dict[CounterStat, tuple[str, str]] = {
    "prompt_tokens_total": ("prompt_tokens_total",
                            "Prompt tokens of requests added to the engine."),
    "generation_tokens_total": ("generation_tokens_total", "Tokens generated."),
    "prefix_cache_queries": ("prefix_cache_queries_total",
                             "Prompt tokens looked up in the prefix cache at admission."),
    "prefix_cache_hits": ("prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("num_preemptions_total", "Sequences preempted (blocks freed, recomputed)."),
}

_defined: dict[str, Any] = {}  # one Ray metric object per name and process


def _metric(kind: type, name: str, description: str, extra: tuple[str, ...] = (),
            **kwargs: Any) -> Any:
    if name not in _defined:
        _defined[name] = kind(PREFIX + name, description, tag_keys=LABELS + extra, **kwargs)
    return _defined[name]


def _histogram(name: str, description: str, buckets: Sequence[float]) -> Histogram:
    return cast(Histogram, _metric(Histogram, name, description, boundaries=list(buckets)))


def served_model_name(cfg: Any) -> str:
    """The ``model_name`` label: the name clients use (as vLLM's ``model_name``)."""
    from engine.default_model import DEFAULT_MODEL_NAME

    return cfg.served_model_name or cfg.engine.model.model or DEFAULT_MODEL_NAME


def _replica_id() -> str:
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


class EngineStatsSource(Protocol):
    """What the metrics read from an engine (``engine.AsyncEngine`` is one)."""

    def get_stats(self) -> EngineStats: ...
    # (duration_s, num_batched_tokens) of each step since the last call
    def pop_step_records(self) -> list[tuple[float, int]]: ...


class WorkerMetrics:
    """One Worker replica's engine metrics; ``start()`` begins the once-a-second flush."""

    def __init__(self, engine: EngineStatsSource, model_name: str, replica: str,
                 precision: dict[str, str] | None = None) -> None:
        self._engine = engine
        self._tags = {"model_name": model_name, "replica": replica}
        if precision is not None:  # dtype, quantization, kv_cache_dtype: model_info's labels
            _metric(Gauge, "model_info", "1; its labels say the precisions in use.",
                    extra=tuple(precision)).set(1.0, tags={**self._tags, **precision})
        self._gauges = {stat: _metric(Gauge, name, description)
                        for stat, (name, description) in _ENGINE_GAUGES.items()}
        self._counters = {stat: _metric(Counter, name, description)
                          for stat, (name, description) in _ENGINE_COUNTERS.items()}
        self._success = _metric(Counter, "request_success_total",
                                "Requests finished, by finish reason (stop, length, abort).",
                                extra=("finished_reason",))
        self._ttft = _histogram("time_to_first_token_seconds",
                                "From arrival at the engine to the first generated token.",
                                TTFT_BUCKETS)
        self._itl = _histogram("inter_token_latency_seconds",
                               "Between consecutive outputs of a request at the Worker.",
                               ITL_BUCKETS)
        self._e2e = _histogram("e2e_request_latency_seconds",
                               "From arrival at the engine to the request's end.", E2E_BUCKETS)
        self._queue = _histogram("request_queue_time_seconds",
                                 "From arrival at the engine to being first scheduled.",
                                 QUEUE_BUCKETS)
        self._step_time = _histogram("iteration_duration_seconds",
                                     "Duration of one engine step (schedule, forward, sample).",
                                     STEP_BUCKETS)
        self._step_tokens = _histogram("iteration_tokens_total",
                                       "Tokens computed in one engine step (prefill + decode).",
                                       STEP_TOKEN_BUCKETS)
        for m in (*self._gauges.values(), *self._counters.values(), self._ttft, self._itl,
                  self._e2e, self._queue, self._step_time, self._step_tokens):
            m.set_default_tags(self._tags)
        self._success.set_default_tags(self._tags)
        self._last = dict.fromkeys(_ENGINE_COUNTERS, 0.0)
        self._itl_pending: list[float] = []
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def for_replica(cls, engine: EngineStatsSource, cfg: Any, replica: str,
                    precision: dict[str, str] | None = None) -> WorkerMetrics:
        """Metrics of Worker replica ``replica``'s engine, flushed from its event loop."""
        metrics = cls(engine, served_model_name(cfg), replica, precision)
        metrics.start()
        return metrics

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._flush_loop())

    async def track(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """Pass a request's outputs through, timing them; a cancelled stream is an abort."""
        itl = self._itl_pending
        last = 0.0
        try:
            async for out in outputs:
                now = time.monotonic()
                if last:
                    itl.append(now - last)
                last = now
                if out.finished:
                    self.request_finished(out)
                yield out
        except asyncio.CancelledError:
            self._success.inc(1, {"finished_reason": "abort"})
            raise

    def request_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        reason = next((co.finish_reason for co in out.outputs if co.finish_reason), "abort")
        self._success.inc(1, {"finished_reason": reason})
        if "arrival_time" not in m:
            return
        arrival = m["arrival_time"]
        self._e2e.observe(m["finished_time"] - arrival)
        if "first_scheduled_time" in m:
            self._queue.observe(m["first_scheduled_time"] - arrival)
        if "first_token_time" in m:
            self._ttft.observe(m["first_token_time"] - arrival)

    def flush(self) -> None:
        """Gauges, counter increases, step records and pending inter-token latencies."""
        stats = self._engine.get_stats()
        for gauge_stat, gauge in self._gauges.items():
            gauge.set(float(stats[gauge_stat]))
        for stat, counter in self._counters.items():
            value = float(stats.get(stat, 0.0))
            if value > self._last[stat]:
                counter.inc(value - self._last[stat])
            self._last[stat] = value
        for duration, tokens in self._engine.pop_step_records():
            self._step_time.observe(duration)
            self._step_tokens.observe(tokens)
        values = self._itl_pending[:]  # the running requests append to this same list
        self._itl_pending.clear()
        for value in values:
            self._itl.observe(value)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL_S)
            try:
                self.flush()
            except Exception:  # never let metrics stop; say why once per failure
                logger.exception("metrics flush failed")


class RouterMetrics:
    """One Router replica's metrics: batch sizes, 429s by cause, HTTP statuses."""

    def __init__(self, model_name: str, replica: str) -> None:
        tags = {"model_name": model_name, "replica": replica}
        self._batch = _histogram("router_batch_size",
                                 "Requests in each batch the Router sends to a Worker.",
                                 BATCH_BUCKETS).set_default_tags(tags)
        self._rejected = _metric(Counter, "router_requests_rejected_total",
                                 "HTTP requests the Router answered with 429, by cause.",
                                 extra=("cause",)).set_default_tags(tags)
        self._http = _metric(Counter, "http_requests_total",
                             "HTTP responses of the Router, by handler and status code.",
                             extra=("handler", "status")).set_default_tags(tags)

    @classmethod
    def for_replica(cls, cfg: Any) -> RouterMetrics:
        """This Router replica's metrics."""
        return cls(served_model_name(cfg), _replica_id())

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
                      "/health"})


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
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path if path in HANDLERS else "other"


def install_http_metrics(app: Any, metrics: RouterMetrics) -> None:
    """Count the app's responses into ``metrics`` (call once, before the app starts)."""
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)
