"""The Router's side of the Worker deployment: batches, aborts, stats and health.

Every call goes through the Worker deployment's handle, so replica choice is
``WorkerRequestRouter``'s: batches to the least loaded (or prefix-affine) replica, control calls
(``target_replica=``) to the replica they name.

A batch whose Worker replica dies (its process killed, the node lost) fails; its requests that
have no output yet, and whose client still listens, are sent once more as a batch of their
own, naming the dead replica so that the request router gives it to another one (or waits for
one). The others get a 503: they have streamed tokens already, so running them again would
repeat output.

Batches share streams: every batch names this client's ``stream_key``; one routed to a replica
that already streams for this client joins that stream (see ``serve_app.worker``), and the
stream's task fans its requests out by request id (``_live``).

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
from collections.abc import Callable
from typing import Any, TypeVar

from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from serve_app.batcher import Batch, EngineRequest, fail_unfinished, fan_out
from serve_app.registry import known_replicas

logger = logging.getLogger("ray.serve")

CONTROL_TIMEOUT_S = 10.0

T = TypeVar("T")


def fresh_call(call: Callable[[], T]) -> T:
    """Run ``call`` (a ``handle....remote(...)``) with its own Serve request ids."""
    return contextvars.Context().run(call)


class WorkerClient:
    def __init__(self, handle: DeploymentHandle, deployment: str = "Worker",
                 grpc: bool = False) -> None:
        self._handle = handle
        # grpc: batches stream over the Worker replica's gRPC server (Serve's by-value path)
        # instead of Ray actor calls whose every message is an object in Ray's object store
        self._stream = handle.options(stream=True, _by_reference=not grpc)
        self._deployment = deployment
        self._background: set[asyncio.Task] = set()
        self._stream_key = uuid.uuid4().hex  # names this client's shared streams
        self._live: dict[str, EngineRequest] = {}  # request id -> request, while unfinished
        self._open: dict[str, Batch] = {}  # Worker stream id -> the batch whose call opened it

    # ---- data path -------------------------------------------------------------------------

    async def run_batch(self, batch: Batch) -> None:
        """Send one batch in one streaming call and fan its messages out (the batcher's sink).
        A batch that joins an open stream hands its requests to that stream's batch."""
        hashes = [r.prefix_hashes for r in batch.requests]
        extra = {"avoid_replica": batch.avoid_replica} if batch.avoid_replica else {}
        for r in batch.requests:
            self._live[r.request_id] = r
        gen = fresh_call(lambda: self._stream.generate_batch.remote(
            requests=[r.wire() for r in batch.requests],
            prefix_hashes=hashes if any(hashes) else None, stream_key=self._stream_key,
            **extra,
        ))
        try:
            joined = await fan_out(batch, gen, self._on_routed, self._live)
            if joined is not None:
                await self._join(batch, joined)
                return
            fail_unfinished(batch, 500, "the Worker ended the stream early")
        except asyncio.CancelledError:
            gen.cancel()  # every listener left: the Worker aborts what is still running
            self._abort_joined_late(batch)
            fail_unfinished(batch, 499, "cancelled")
        except Exception as exc:
            logger.warning("batch of %d failed: %s", len(batch.requests), exc)
            retry = [r for r in batch.requests if isinstance(exc, RayActorError)
                     and batch.attempt == 0 and _not_started(r)]
            rest = Batch([r for r in batch.requests if r not in retry])
            fail_unfinished(rest, 503, f"Worker unavailable: {type(exc).__name__}")
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

    def _on_routed(self, requests: list[EngineRequest]) -> None:
        """A batch opened a stream: batches that join it find it here."""
        batch = requests[0].batch if requests else None
        if batch is not None and batch.stream_id is not None:
            self._open[batch.stream_id] = batch
        self._abort_released(requests)

    async def _join(self, batch: Batch, stream_id: str) -> None:
        """``batch`` joined an open stream: that stream's task now carries its requests. The
        stream's first message can reach us after the join's answer: wait for it."""
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        while stream_id not in self._open and time.monotonic() < deadline:
            if all(r.finished for r in batch.requests):
                return  # the stream came and went, and carried them to the end
            await asyncio.sleep(0.001)
        stream = self._open.get(stream_id)
        if stream is None:
            fail_unfinished(batch, 503, "the Worker stream was lost; retry the request")
            return
        stream.requests.extend(batch.requests)
        for r in batch.requests:
            r.batch = stream
        self._abort_released(batch.requests)

    def _abort_joined_late(self, batch: Batch) -> None:
        """A cancelled call may have joined a stream already: abort those requests there."""
        routed = [r for r in batch.requests if r.replica is not None and not r.finished]
        if routed:
            self.abort(routed[0].replica, [r.request_id for r in routed])

    async def _retry(self, failed: Batch, requests: list[EngineRequest]) -> None:
        """Run ``requests`` again in this task (so a client leaving still cancels them)."""
        logger.info("retrying %d requests of a batch whose Worker died", len(requests))
        again = Batch(requests, task=failed.task, attempt=failed.attempt + 1,
                      avoid_replica=requests[0].replica, on_routed=failed.on_routed)
        failed.on_routed = None  # the retry's answer is the one the batcher waits for
        for r in requests:
            r.batch, r.replica = again, None  # no abort to the dead replica
        await self.run_batch(again)

    def release(self, request: EngineRequest) -> None:
        """The handler stops listening (done, stop string, or client gone): free the request."""
        if request.released:
            return
        request.released = True
        batch = request.batch
        if request.finished or batch is None:
            return
        if request.replica is not None:
            # Routed: abort it there. Its stream may carry other batches' requests (and more
            # may be joining), so the stream's call is never cancelled for a client leaving.
            self.abort(request.replica, [request.request_id])
        elif batch.all_released() and batch.task is not None and not batch.task.done():
            batch.task.cancel()  # not at a Worker yet: drop the call

    def _abort_released(self, requests: list[EngineRequest]) -> None:
        released = [r for r in requests if r.released and not r.finished]
        if released and released[0].replica is not None:
            self.abort(released[0].replica, [r.request_id for r in released])

    def abort(self, replica: str, request_ids: list[str]) -> None:
        """Abort at the replica that holds the requests (fire and forget, bounded)."""
        call = fresh_call(lambda: self._handle.abort.remote(request_ids=request_ids,
                                                             target_replica=replica))
        self._spawn(_bounded(call, CONTROL_TIMEOUT_S))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- control -----------------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        return await fresh_call(lambda: self._handle.model_info.remote())

    def replicas(self) -> list[str]:
        return known_replicas(self._deployment)

    async def stats(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """``get_stats()`` of every running Worker replica that answers in time."""
        calls = [fresh_call(lambda r=rid: self._handle.get_stats.remote(target_replica=r))
                 for rid in self.replicas()]
        results = await asyncio.gather(*(_bounded(c, timeout_s) for c in calls))
        return [r for r in results if r is not None]


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
