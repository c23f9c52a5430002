"""Worker deployment: one replica = one engine (one model instance).

It accepts batches of already-tokenized requests (``WorkerRequest``) in one streaming handle
call and streams back a ``StreamAttach``, then one ``StepMessage`` per engine step with every
request's new token ids (and logprobs), ends and errors (``serve_app.wire``).

Shared streams: a Router names itself with ``stream_key``. A batch routed to a replica that
already streams for that key joins that stream instead of opening one: its call answers
``StreamAttach(replica, <that stream's id>, attached=True)`` and ends, and its requests' tokens
travel in the open stream's per-step messages. A Router with many small batches in flight (one
per arriving request, under steady load) then gets one message per engine step, not one per
batch. A stream ends when its last request does. Cancelling a stream's call aborts every
request it carries.

The engine is ``build_engine``'s ``AsyncEngine`` unless ``engine_factory`` gives another one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from ray import serve

from engine import AsyncEngineStats, EngineConfig, EngineDeadError, RequestOutput, SamplingParams
from serve_app import wire
from serve_app.config import AppConfig
from serve_app.metrics.worker import EngineStatsSource, WorkerMetrics, engine_info, rss_bytes
from serve_app.router.demand import DemandReceiver
from serve_app.worker import startup

logger = logging.getLogger("ray.serve")


class ServingEngine(EngineStatsSource, Protocol):
    """What a Worker uses of its engine (``engine.AsyncEngine`` is one)."""

    model_name: str
    max_model_len: int
    vocab_size: int  # token ids it accepts: [0, vocab_size)
    dtype: Any  # the activations' torch dtype
    quantization: str | None  # the weights' format ("int8", ...); None: in dtype
    kv_cache_dtype: str  # what the KV cache holds: "fp8_e4m3" or the dtype's name
    default_sampling: dict[str, Any]  # generation_config.json's defaults (SamplingParams names)
    tokenizer: Any
    config: EngineConfig

    @property
    def is_running(self) -> bool: ...
    def get_stats(self) -> AsyncEngineStats: ...
    # one request's outputs (deltas); closing the stream early aborts the request
    def generate(self, request_id: str, prompt: list[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]: ...
    def abort(self, request_id: str) -> None: ...
    def check_health(self) -> None: ...  # raises when no request can be served
    def shutdown(self) -> None: ...


class _Stream:
    """One open ``generate_batch`` call: its queue and the requests it carries."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.queue: asyncio.Queue[wire.Part] = asyncio.Queue()
        self.pumps: dict[str, asyncio.Task[None]] = {}  # request id -> its pump
        self.remaining = 0  # requests not finished yet


class Worker(DemandReceiver, startup.StartTimed):
    """Owns an engine; batches in, per-step token messages out."""

    def __init__(self, config: AppConfig,
                 engine_factory: Callable[[AppConfig], ServingEngine] | None = None,
                 replica_id: str | None = None) -> None:
        """``engine_factory`` (default ``build_engine``) is called once, here; ``replica_id``
        defaults to Serve's id of this replica (give it outside Serve)."""
        self.engine = (engine_factory or build_engine)(config)
        self.replica_id = replica_id or serve.get_replica_context().replica_id.unique_id
        self.metrics = WorkerMetrics.for_replica(self.engine, config, self.replica_id,
                                                 engine_info(self.engine))
        self._pumps: dict[str, asyncio.Task[None]] = {}  # request id -> task streaming it
        self._streams: dict[str, _Stream] = {}  # stream_key -> that Router's open stream
        self._received: dict[str, int] = {}  # stream_key -> requests received (routing stats)
        self.requests_total = 0
        self.aborted_total = 0  # requests aborted here: a control call, or their stream closed
        self.batches_total = 0
        self.batches_running = 0
        self.drain_timeout_s = config.worker_drain_timeout_s

    # ---- data path -------------------------------------------------------------------------

    async def generate_batch(self, requests: list[wire.WorkerRequest],
                             prefix_hashes: list[list[int]] | None = None,
                             avoid_replica: str | None = None, stream_key: str | None = None,
                             ) -> AsyncIterator[wire.WorkerMessage]:
        """Run a batch. ``prefix_hashes`` and ``avoid_replica`` are read by the request router
        only."""
        del prefix_hashes, avoid_replica
        self.batches_total += 1
        self.requests_total += len(requests)
        key = stream_key or ""
        self._received[key] = self._received.get(key, 0) + len(requests)
        stream = self._streams.get(stream_key) if stream_key is not None else None
        if stream is not None:  # join the Router's open stream on this replica
            self._attach(stream, requests, by_id=True)
            yield wire.StreamAttach(self.replica_id, stream.id, attached=True)
            return
        stream = _Stream()
        if stream_key is not None:
            self._streams[stream_key] = stream
        self.batches_running += 1
        self._attach(stream, requests, by_id=stream_key is not None)
        try:
            yield wire.StreamAttach(self.replica_id, stream.id, attached=False)
            while stream.remaining:
                message = wire.StepMessage.gather(await stream.queue.get(), stream.queue)
                stream.remaining -= message.num_finished
                self.demand.finished.add(message.num_finished)
                yield message  # batches may join while this waits for the consumer
        finally:
            if stream_key is not None and self._streams.get(stream_key) is stream:
                del self._streams[stream_key]  # before any await: no batch joins a closed stream
            self.batches_running -= 1
            for request_id, task in stream.pumps.items():
                self._pumps.pop(request_id, None)
                task.cancel()  # closing a generate() stream aborts its request

    def _attach(self, stream: _Stream, requests: list[wire.WorkerRequest], by_id: bool) -> None:
        for slot, req in enumerate(requests):
            key: int | str = req.request_id if by_id else slot
            task = asyncio.create_task(self._pump(key, req, stream.queue))
            stream.pumps[req.request_id] = task
            self._pumps[req.request_id] = task
        stream.remaining += len(requests)

    async def _pump(self, key: int | str, req: wire.WorkerRequest,
                    queue: asyncio.Queue[wire.Part]) -> None:
        put = queue.put_nowait
        cached, prompt_logprobs = 0, None
        try:
            outputs = self.engine.generate(req.request_id, req.prompt_token_ids, req.params)
            async for out in self.metrics.track(outputs):
                cached = out.num_cached_tokens
                prompt_logprobs = out.prompt_logprobs or prompt_logprobs  # (sent once)
                for co in out.outputs:
                    if co.token_ids or co.finish_reason:
                        put(wire.TokenPart(key, co.index, co.token_ids, co.finish_reason,
                                           co.logprobs))
        except asyncio.CancelledError:  # aborted (control call) or the batch call was cancelled
            self.aborted_total += 1
            put(wire.DonePart(key, len(req.prompt_token_ids), cached))
            raise
        except ValueError as exc:
            put(wire.ErrorPart(key, 400, str(exc)))
            return
        except EngineDeadError as exc:  # stopped or stalled: Serve replaces this replica
            put(wire.ErrorPart(key, 503, str(exc)))
            return
        except Exception as exc:  # the engine failed: report it for this request, keep serving
            logger.exception("request %s failed", req.request_id)
            put(wire.ErrorPart(key, 500, f"engine error: {type(exc).__name__}: {exc}"))
            return
        put(wire.DonePart(key, len(req.prompt_token_ids), cached, prompt_logprobs))

    # ---- control calls (routed to the named replica by WorkerRequestRouter) ----------------

    async def abort(self, request_ids: list[str], reason: wire.AbortReason = "abort",
                    target_replica: str | None = None) -> int:
        """Abort requests of this replica (``reason``: why, for the metrics); returns how many
        were still running here."""
        found = 0
        for request_id in request_ids:
            task = self._pumps.pop(request_id, None)
            if task is not None:
                found += 1
                task.cancel(reason)  # ends its generate() stream, which aborts it in the engine
            self.engine.abort(request_id)
        return found

    async def model_info(self, target_replica: str | None = None) -> wire.ModelInfo:
        """What the Router needs: the tokenizer, names and limits."""
        return {
            "replica": self.replica_id,
            "model_name": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "quantization": self.engine.quantization,
            "kv_cache_dtype": self.engine.kv_cache_dtype,
            "default_sampling": self.engine.default_sampling,
            "tokenizer": self.engine.tokenizer,
        }

    async def get_stats(self, target_replica: str | None = None) -> wire.WorkerStats:
        """The engine's stats and this replica's counters (the Router's ``/v1/stats``)."""
        return {**self.engine.get_stats(), "replica": self.replica_id,
                "requests_total": self.requests_total, "aborted_total": self.aborted_total,
                "rss_bytes": rss_bytes(), "batches_total": self.batches_total,
                "batches_running": self.batches_running, "demand": self.demand.stats()}

    # ---- hooks Serve calls -----------------------------------------------------------------

    def record_routing_stats(self) -> wire.RoutingStats:
        """Load for ``WorkerRequestRouter``: collected every ``routing_stats_period_s``."""
        s = self.engine.get_stats()
        # The engine's snapshot can predate a batch this replica already accepted; count the
        # requests of open batches too, so a report never hides work the router sent.
        waiting = max(s["num_waiting"], len(self._pumps) - s["num_running"])
        return {"num_waiting": waiting, "num_running": s["num_running"],
                "num_free_blocks": s["num_free_blocks"], "num_total_blocks": s["num_total_blocks"],
                "received": dict(self._received), "stopped": not self.engine.is_running,
                "finished_per_s": self.demand.finished.rate()}

    def record_autoscaling_stats(self) -> wire.AutoscalingStats:
        """The real load, for ``serve_app.autoscaling.policy.QueueDepthPolicy``: one handle call carries
        a whole batch, so Serve's count of ongoing calls says little."""
        s = self.engine.get_stats()
        slots = self.engine.config.scheduler.max_num_seqs
        return {"num_waiting": float(s["num_waiting"]), "num_running": float(s["num_running"]),
                "kv_cache_usage": float(s["kv_cache_usage"]),
                "seq_slot_usage": float(s["num_running"]) / slots,
                "output_tokens_per_s": s["output_tokens_per_s"], **self.demand.stats()}

    def check_health(self) -> None:
        """Serve's probe, on this replica's event loop (the engine's check never blocks)."""
        self.engine.check_health()  # a stalled step, a stopped loop, a dead rank

    def __del__(self) -> Awaitable[None] | None:
        """Stop the engine. Serve calls this when it removes the replica and awaits the result.

        Removal (scale-down, redeploy) takes the replica out of routing first, so it gets no
        new batch, then Serve waits for its ongoing calls (the batches it streams) up to
        ``worker_drain_timeout_s``, then calls this. A batch still streaming here then (admitted
        as the drain ended) is finished first, within the same bound. From the garbage
        collector (no batch running, no event loop), the engine stops at once.
        """
        engine = getattr(self, "engine", None)
        if engine is None:
            return None
        if getattr(self, "batches_running", 0) and _has_running_loop():
            return self._finish_batches_then_stop(engine)
        engine.shutdown()
        return None

    async def _finish_batches_then_stop(self, engine: ServingEngine) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.batches_running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.batches_running:
            logger.warning("Worker stops with %d batches unfinished after %.0fs",
                           self.batches_running, self.drain_timeout_s)
        engine.shutdown()


def build_engine(config: AppConfig) -> ServingEngine:
    """The default engine: an ``AsyncEngine`` of the config's engine settings; on a CPU, it
    computes with ``worker_threads()`` threads (unless ``num_threads`` is set; the engine's loop
    thread sets torch's count for itself); tensor-parallel ranks 1..N-1 run as Ray actors in
    this replica's placement group."""
    from engine import AsyncEngine

    engine_cfg = config.engine
    if engine_cfg.device.num_threads is None and not config.use_gpu():
        engine_cfg = engine_cfg.model_copy(deep=True)
        engine_cfg.device.num_threads = config.worker_threads()
    return AsyncEngine(engine_cfg, rank_launcher=_rank_launcher(config))


def _rank_launcher(config: AppConfig) -> Any:
    """Starts tensor-parallel ranks 1..N-1 as Ray actors in this replica's placement group
    (None with one rank)."""
    if config.engine.parallel.tensor_parallel_size == 1:
        return None
    from serve_app.worker.tp_ranks import RayRankLauncher

    replica = serve.get_replica_context().replica_id.unique_id
    return RayRankLauncher(f"pagedserve-tp-{replica}", num_cpus=config.worker_num_cpus,
                           num_gpus=1 if config.use_gpu() else 0)


def _has_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
