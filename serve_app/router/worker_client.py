"""The Router's side of the Worker deployment: batches, aborts, stats and health.

Every call goes through the Worker deployment's handle, so replica choice is
``WorkerRequestRouter``'s: batches to the least loaded (or prefix-affine) replica, control calls
(``target_replica=``) to the replica they name.

A batch whose Worker replica dies (its process killed, the node lost) fails; its requests that
have no output yet, and whose client still listens, are sent once more as a batch of their
own, naming the dead replica so that the request router gives it to another one (or waits for
one). The others get a 503: they have streamed tokens already, so running them again would
repeat output.

A batch's call streams ``serve_app.wire`` messages; ``fan_out`` (``serve_app.router.fan_out``)
hands each request the parts meant for it (``EngineRequest.events``). Batches share streams: every batch names this client's
``stream_key``; one routed to a replica that already streams for this client joins that stream
(see ``serve_app.worker.worker``), and the stream's task fans its requests out by request id
(``_live``).

Handle calls are made in an empty ``contextvars.Context``: inside an HTTP request, Serve gives
every handle call that request's internal request id, and its request router matches pending
calls to replicas by that id, so two calls from one request (stats for two replicas, two
batches flushed from one request's timer) would be routed to each other's replica or hang.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from serve_app import wire
from serve_app.cluster.registry import known_replicas
from serve_app.router.batch import Batch, EngineRequest
from serve_app.router.fan_out import fail_unfinished, fan_out

logger = logging.getLogger("ray.serve")

CONTROL_TIMEOUT_S = 10.0

T = TypeVar("T")


def fresh_call(call: Callable[[], T]) -> T:
    """Run ``call`` (a ``handle....remote(...)``) with its own Serve request ids."""
    return contextvars.Context().run(call)


class WorkerClient:
    def __init__(self, handle: DeploymentHandle[Any], deployment: str = "Worker",
                 grpc: bool = False) -> None:
        self._handle = handle
        # grpc: batches stream over the Worker replica's gRPC server (Serve's by-value path)
        # instead of Ray actor calls whose every message is an object in Ray's object store
        self._stream = handle.options(stream=True, _by_reference=not grpc)
        self._deployment = deployment
        self._background: set[asyncio.Task[Any]] = set()
        self._stream_key = uuid.uuid4().hex  # names this client's shared streams
        self._live: dict[str, EngineRequest] = {}  # request id -> request, while unfinished
        self._open: dict[str, Batch] = {}  # Worker stream id -> the batch whose call opened it
        # Worker stream id -> resolved when it opens, for batches that joined it before
        self._opening: dict[str, asyncio.Future[None]] = {}

    # ---- data path -------------------------------------------------------------------------

    async def run_batch(self, batch: Batch) -> None:
        """Send one batch in one streaming call and fan its messages out (the batcher's sink).
        A batch that joins an open stream hands its requests to that stream's batch."""
        hashes = [r.prefix_hashes for r in batch.requests]
        extra = {"avoid_replica": batch.avoid_replica} if batch.avoid_replica else {}
        for r in batch.requests:
            self._live[r.request_id] = r
        # a DeploymentResponseGenerator of wire.WorkerMessage (Ray types it loosely)
        gen: Any = fresh_call(lambda: self._stream.generate_batch.remote(
            requests=[r.wire() for r in batch.requests],
            prefix_hashes=hashes if any(hashes) else None, stream_key=self._stream_key,
            **extra,
        ))
        try:
            joined = await fan_out(batch, gen, self._on_opened, self._live)
            if joined is not None:
                await self._join(batch, joined)
                return
            fail_unfinished(batch.requests, 500, "the Worker ended the stream early")
        except asyncio.CancelledError:
            gen.cancel()  # every listener left: the Worker aborts what is still running
            self._abort_joined_late(batch)
            fail_unfinished(batch.requests, 499, "cancelled")
        except Exception as exc:
            logger.warning("batch of %d failed: %s", len(batch.requests), exc)
            retry = [r for r in batch.requests if isinstance(exc, RayActorError)
                     and batch.attempt == 0 and _not_started(r)]
            fail_unfinished([r for r in batch.requests if r not in retry], 503,
                            f"Worker unavailable: {type(exc).__name__}")
            if retry:
                self._close(batch)  # no batch joins a dead replica's stream
                await self._retry(batch, retry)
        finally:
            self._close(batch)
            batch.routed_or_over()  # a retried batch's call ends here, not with its task

    def _close(self, batch: Batch) -> None:
        """The batch's call is over: it no longer takes joins; its finished requests leave."""
        if batch.stream_id is not None and self._open.get(batch.stream_id) is batch:
            del self._open[batch.stream_id]
        for r in batch.requests:
            if r.finished:
                self._live.pop(r.request_id, None)

    def _on_opened(self, batch: Batch) -> None:
        """A batch opened a stream: batches that join it find it here."""
        if batch.stream_id is not None:
            self._open[batch.stream_id] = batch
            waiter = self._opening.pop(batch.stream_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._abort_released(batch.requests)

    async def _join(self, batch: Batch, stream_id: str) -> None:
        """``batch`` joined an open stream: that stream's batch now carries its requests.

        The stream's first message can reach us after the join's answer: wait for it, up to
        ``CONTROL_TIMEOUT_S``, unless the stream came and went and carried them to the end.
        """
        if stream_id not in self._open and not all(r.finished for r in batch.requests):
            waiter = self._opening.get(stream_id)
            if waiter is None:
                waiter = self._opening[stream_id] = asyncio.get_running_loop().create_future()
            await asyncio.wait([waiter], timeout=CONTROL_TIMEOUT_S)
            if self._opening.get(stream_id) is waiter:
                del self._opening[stream_id]  # timed out: never opened here
        stream = self._open.get(stream_id)
        if stream is None:  # never opened in time, or came and went (ended requests stay so)
            fail_unfinished(batch.requests, 503, "the Worker stream was lost; retry the request")
            return
        stream.adopt(batch.requests)
        self._abort_released(batch.requests)

    def _abort_joined_late(self, batch: Batch) -> None:
        """A cancelled call may have joined a stream already: abort those requests there."""
        routed = [r for r in batch.requests if r.replica is not None and not r.finished]
        if routed and routed[0].replica is not None:
            self.abort(routed[0].replica, [r.request_id for r in routed])

    async def _retry(self, failed: Batch, requests: list[EngineRequest]) -> None:
        """Run ``requests`` again in this task (so a client leaving still cancels them)."""
        logger.info("retrying %d requests of a batch whose Worker died", len(requests))
        await self.run_batch(failed.retry(requests))

    def release(self, request: EngineRequest, reason: wire.AbortReason = "abort") -> None:
        """The handler stops listening (done, stop string, or client gone): free the request
        (``reason`` says why, if it is still running at a Worker)."""
        if not request.release():
            return
        batch = request.batch
        if request.finished or batch is None:
            return
        if request.replica is not None:
            # Routed: abort it there. Its stream may carry other batches' requests (and more
            # may be joining), so the stream's call is never cancelled for a client leaving.
            self.abort(request.replica, [request.request_id], reason)
        elif batch.all_released() and batch.task is not None and not batch.task.done():
            batch.task.cancel()  # not at a Worker yet: drop the call

    def _abort_released(self, requests: list[EngineRequest]) -> None:
        released = [r for r in requests if r.released and not r.finished]
        if released and released[0].replica is not None:
            self.abort(released[0].replica, [r.request_id for r in released])

    def abort(self, replica: str, request_ids: list[str],
              reason: wire.AbortReason = "abort") -> None:
        """Abort at the replica that holds the requests (fire and forget, bounded)."""
        call = fresh_call(lambda: self._handle.abort.remote(
            request_ids=request_ids, reason=reason, target_replica=replica))
        self._spawn(_bounded(call, CONTROL_TIMEOUT_S))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- control -----------------------------------------------------------------------------

    async def model_info(self) -> wire.ModelInfo:
        info: wire.ModelInfo = await fresh_call(lambda: self._handle.model_info.remote())
        return info

    def replicas(self) -> list[str]:
        return known_replicas(self._deployment)

    async def stats(self, timeout_s: float = 5.0) -> list[wire.WorkerStats]:
        """``get_stats()`` of every running Worker replica that answers in time."""
        def call(replica: str) -> Any:
            return fresh_call(lambda: self._handle.get_stats.remote(target_replica=replica))

        calls = [call(rid) for rid in self.replicas()]
        results = await asyncio.gather(*(_bounded(c, timeout_s) for c in calls))
        return [r for r in results if r is not None]


def sum_stats(stats: list[wire.WorkerStats]) -> dict[str, float]:
    """The sum of every numeric field over the replicas' stats."""
    totals: dict[str, float] = {}
    for replica in stats:
        for k, v in replica.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                totals[k] = totals.get(k, 0) + v
    return totals


def _not_started(r: EngineRequest) -> bool:
    """Nothing of it reached the client, which still listens: running it again is invisible."""
    return not r.finished and not r.released and r.first_output_at is None


async def _bounded(call: Any, timeout_s: float) -> Any:
    """Await a handle call; on timeout or failure cancel it and return None."""
    start = time.monotonic()
    try:
        return await asyncio.wait_for(_await(call), timeout_s)
    except Exception as exc:
        call.cancel()
        logger.warning("Worker control call failed after %.1fs: %r", time.monotonic() - start, exc)
        return None


async def _await(call: Any) -> Any:
    return await call
