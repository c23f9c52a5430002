"""The records the Router's batcher batches: ``EngineRequest`` (one prompt on its way through
a Worker) and ``Batch`` (the requests sent in one Worker call).

Both change state only through their own methods: the batcher, the Worker client
(``serve_app/router/worker_client.py``), the Router and the response streams read their fields
and call these. Nothing here knows about HTTP or Ray.
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
