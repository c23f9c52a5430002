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
from collections.abc import AsyncIterator, Awaitable, Callable

from ray import serve

from serve_app import wire
from serve_app.config import AppConfig
from serve_app.metrics.worker import WorkerMetrics, engine_info, rss_bytes
from serve_app.router.demand import DemandReceiver
from serve_app.worker import startup
from serve_app.worker.batch_stream import BatchStream
from serve_app.worker.serving_engine import ServingEngine, build_engine

logger = logging.getLogger("ray.serve")


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
        self._running: set[BatchStream] = set()  # the open streams
        self._streams: dict[str, BatchStream] = {}  # stream_key -> that Router's open stream
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
            stream.add(requests, by_id=True)
            yield wire.StreamAttach(self.replica_id, stream.id, attached=True)
            return
        stream = BatchStream(self.engine.add_batch([]), self.metrics)
        if stream_key is not None:
            self._streams[stream_key] = stream
        self.batches_running += 1
        self._running.add(stream)
        stream.add(requests, by_id=stream_key is not None)
        try:
            yield wire.StreamAttach(self.replica_id, stream.id, attached=False)
            async for record in stream.steps:  # batches may join while a message is out
                message = stream.message(record)
                self.demand.finished.add(message.num_finished)
                yield message
        finally:
            if stream_key is not None and self._streams.get(stream_key) is stream:
                del self._streams[stream_key]  # before any await: no batch joins a closed stream
            self.batches_running -= 1
            self._close(stream)

    def _close(self, stream: BatchStream) -> None:
        """The call is over (its requests done, or the call cancelled): abort what is open."""
        self._running.discard(stream)
        still_open = stream.steps.open
        self.aborted_total += len(still_open)
        for _ in still_open:
            self.metrics.request_aborted("abort")
        stream.steps.close()

    # ---- control calls (routed to the named replica by WorkerRequestRouter) ----------------

    async def abort(self, request_ids: list[str], reason: wire.AbortReason = "abort",
                    target_replica: str | None = None) -> int:
        """Abort requests of this replica (``reason``: why, for the metrics); returns how many
        were still running here."""
        found = 0
        for request_id in request_ids:
            for stream in self._running:
                if stream.abort([request_id]):  # its DonePart goes out in the next message
                    found += 1
                    self.aborted_total += 1
                    self.metrics.request_aborted(reason)
            self.engine.abort(request_id)  # wherever it is, in no stream of this replica too
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
        carried = sum(len(stream.requests) for stream in self._running)
        waiting = max(s["num_waiting"], carried - s["num_running"])
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


def _has_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
