"""The Router's dynamic batcher, and the records it batches.

``DynamicBatcher.submit`` queues ``EngineRequest``s; a ``Batch`` is sent when
``max_batch_size`` requests wait or ``batch_wait_s`` has passed since the oldest (sooner when no
batch is on its way to a Worker, see the class). The sink that sends it (the Router's
``WorkerClient.run_batch``) streams the Worker's answer and hands each request the parts meant
for it (``serve_app.wire``).

The two records change state only through their own methods: the Worker client, the Router
and the response streams read their fields and call these. This module knows nothing about
HTTP or Ray, so it is tested with a fake Worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from engine import SamplingParams
from serve_app.wire import DonePart, ErrorPart, Part, WorkerRequest

BatchSink = Callable[["Batch"], Coroutine[Any, Any, None]]


@dataclass(eq=False)
class EngineRequest:
    """One prompt on its way through a Worker.

    Its handler reads ``events``: ``(request, part)`` for each part the Worker sent about it
    (the requests of one HTTP call may share one queue), up to a ``DonePart`` or an
    ``ErrorPart``, which is the last.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    prefix_hashes: list[int] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    events: asyncio.Queue[tuple[EngineRequest, Part]] = field(default_factory=asyncio.Queue)
    replica: str | None = None  # the Worker replica that holds it, once routed
    routed: asyncio.Event = field(default_factory=asyncio.Event)  # routed, or over
    submitted_at: float = field(default_factory=time.monotonic)
    arrived_at: float = field(default_factory=time.monotonic)  # at the HTTP server
    first_output_at: float | None = None
    finished: bool = False  # the Worker is done with it (its last event is queued)
    released: bool = False  # the handler no longer listens
    batch: Batch | None = None  # the batch whose stream carries it

    def wire(self) -> WorkerRequest:
        return WorkerRequest(self.request_id, self.prompt_token_ids, self.params)

    def note_output(self, now: float) -> bool:
        """Output for it arrived at ``now``; True when it is its first."""
        if self.first_output_at is not None:
            return False
        self.first_output_at = now
        return True

    def put(self, part: Part) -> None:
        self.events.put_nowait((self, part))

    def finish(self, part: DonePart | ErrorPart) -> None:
        """Its last event: the Worker is done with it."""
        self.finished = True
        self.put(part)

    def fail(self, status: int, message: str) -> None:
        """End it with an error, unless the Worker ended it already; stop waiting for a route."""
        self.routed.set()
        if not self.finished:
            self.finish(ErrorPart(self.request_id, status, message))

    def release(self) -> bool:
        """The handler stops listening; False when it had already."""
        if self.released:
            return False
        self.released = True
        return True


@dataclass(eq=False)
class Batch:
    """Requests sent in one ``generate_batch`` call; a batch that opens a Worker stream may
    take in the requests of later batches that join it (``adopt``)."""

    requests: list[EngineRequest]
    task: asyncio.Task[None] | None = None  # the task that sends it
    attempt: int = 0  # 1 when these requests are retried after their Worker died
    avoid_replica: str | None = None  # the replica that died: the retry goes elsewhere
    on_routed: Callable[[], None] | None = None  # the batcher's, called once: routed or over
    stream_id: str | None = None  # the Worker stream this batch's call opened

    def __post_init__(self) -> None:
        for r in self.requests:
            r.batch = self

    def start(self, send: BatchSink) -> None:
        """Send it in a task of its own; the task's end counts as routed-or-over."""
        self.task = asyncio.get_running_loop().create_task(send(self))
        self.task.add_done_callback(lambda _: self.routed_or_over())

    def mark_routed(self, replica: str | None) -> None:
        """The Worker answered (``replica``; None when the call failed before it did)."""
        for r in self.requests:
            if replica is not None:
                r.replica = replica
            r.routed.set()
        self.routed_or_over()

    def routed_or_over(self) -> None:
        hook, self.on_routed = self.on_routed, None
        if hook is not None:
            hook()

    def open_stream(self, stream_id: str) -> None:
        """Its call opened Worker stream ``stream_id``: batches may join it."""
        self.stream_id = stream_id

    def adopt(self, requests: list[EngineRequest]) -> None:
        """Requests of a batch that joined this batch's stream: they travel in it now."""
        self.requests.extend(requests)
        for r in requests:
            r.batch = self

    def retry(self, requests: list[EngineRequest]) -> Batch:
        """A batch of ``requests`` (of this one, whose Worker died) to send once more,
        elsewhere; it takes over the batcher's hook, and nothing is aborted at the dead
        replica."""
        again = Batch(requests, task=self.task, attempt=self.attempt + 1,
                      avoid_replica=requests[0].replica, on_routed=self.on_routed)
        self.on_routed = None  # the retry's answer is the one the batcher waits for
        for r in requests:
            r.replica = None
        return again

    def all_released(self) -> bool:
        return all(r.released or r.finished for r in self.requests)


class DynamicBatcher:
    """Collects requests into batches; ``send_batch`` runs each batch in its own task.

    A request that arrives while no batch is on its way to a Worker (sent, not yet routed) goes
    at once, with the other prompts of its HTTP request: waiting would only add latency.
    Requests that arrive while one is on its way wait for it, and go together when it is routed
    (``Batch.mark_routed``) or its call ends, when ``max_batch_size`` of them wait,
    or ``batch_wait_s`` after the oldest arrived, whichever comes first.
    """

    def __init__(self, send_batch: BatchSink, max_batch_size: int, batch_wait_s: float) -> None:
        self._send_batch = send_batch
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self._waiting: list[EngineRequest] = []
        self._timer: asyncio.TimerHandle | None = None
        self._unrouted = 0  # batches sent whose Worker has not answered yet
        self.batch_sizes: dict[int, int] = {}  # batch size -> how many batches were sent

    def submit(self, *requests: EngineRequest) -> None:
        """Queue the prompts of one HTTP request: they go in the same batch when they fit."""
        self._waiting.extend(requests)
        if (len(self._waiting) >= self.max_batch_size or self.batch_wait_s <= 0
                or not self._unrouted):
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.batch_wait_s, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiting:
            requests = self._waiting[: self.max_batch_size]
            del self._waiting[: self.max_batch_size]
            self.batch_sizes[len(requests)] = self.batch_sizes.get(len(requests), 0) + 1
            self._unrouted += 1
            Batch(requests, on_routed=self._on_routed).start(self._send_batch)

    def _on_routed(self) -> None:
        """A batch reached a Worker (or its call ended first): send what waited for it."""
        self._unrouted -= 1
        if not self._unrouted and self._waiting:
            self.flush()

    def discard(self, request: EngineRequest) -> bool:
        """Drop a request that is still waiting here; True if it was."""
        if request in self._waiting:
            self._waiting.remove(request)
            return True
        return False
