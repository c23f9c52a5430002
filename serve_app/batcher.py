"""The Router's dynamic batcher and the fan-out of Worker messages to per-request queues.

``DynamicBatcher.submit`` queues an ``EngineRequest``; a batch is sent when ``max_batch_size``
requests wait or ``batch_wait_s`` has passed since the oldest. ``send_batch`` (the Router's
``WorkerClient.run_batch``) streams the Worker's per-step messages and puts each request's part
on its ``events`` queue as ``(request, event)`` (the requests of one HTTP call may share one
queue), where ``event`` is one of:

    ("t", index, token_ids, finish_reason, logprobs)   new tokens of sequence ``index``
    ("done", num_prompt_tokens, num_cached_tokens)      the request is finished at the Worker
    ("err", status, message)                           it failed (no more events follow)

This module knows nothing about HTTP or Ray, so it is tested with a fake Worker.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams

Event = tuple


@dataclass(eq=False)
class EngineRequest:
    """One prompt on its way through a Worker; the HTTP handler reads ``events``."""

    prompt_token_ids: list[int]
    params: SamplingParams
    prefix_hashes: list[int] = field(default_factory=list)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    events: asyncio.Queue[tuple[EngineRequest, Event]] = field(default_factory=asyncio.Queue)
    replica: str | None = None
    routed: asyncio.Event = field(default_factory=asyncio.Event)
    submitted_at: float = field(default_factory=time.monotonic)
    first_output_at: float | None = None
    finished: bool = False  # the Worker is done with it (done/err seen)
    released: bool = False  # the handler no longer listens
    batch: Batch | None = None

    def wire(self) -> tuple[str, list[int], SamplingParams]:
        return self.request_id, self.prompt_token_ids, self.params


@dataclass(eq=False)
class Batch:
    requests: list[EngineRequest]
    task: asyncio.Task | None = None
    attempt: int = 0  # 1 when these requests are retried after their Worker died
    stream_id: str | None = None  # the Worker stream this batch's call opened
    avoid_replica: str | None = None  # the replica that died: the retry goes elsewhere
    on_routed: Callable[[], None] | None = None  # the batcher's, called once: routed or over

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

    def __init__(self, send_batch: Callable[[Batch], Awaitable[None]], max_batch_size: int,
                 batch_wait_s: float) -> None:
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
            batch = Batch(requests, on_routed=self._on_routed)
            for r in requests:
                r.batch = batch
            self.batch_sizes[len(requests)] = self.batch_sizes.get(len(requests), 0) + 1
            self._unrouted += 1
            batch.task = asyncio.get_running_loop().create_task(self._send_batch(batch))
            batch.task.add_done_callback(lambda _, b=batch: b.routed_or_over())

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


async def fan_out(batch: Batch, messages: AsyncIterator[dict[str, Any]],
                  on_routed: Callable[[list[EngineRequest]], None] | None = None,
                  live: dict[str, EngineRequest] | None = None) -> str | None:
    """Route each Worker message's parts to the requests' queues.

    Parts name their request by position in the batch, or by request id, looked up in
    ``live`` (a stream shared by several batches; finished requests leave ``live``).
    ``on_routed`` sees the batch once its replica is known and it streams (to abort requests
    already gone). Returns the stream's id when the batch joined an open stream there (its call
    then ends at once and the stream's own ``fan_out`` carries the requests), else None when the
    stream ended.
    """
    def find(key: int | str) -> EngineRequest | None:
        if isinstance(key, int):
            return batch.requests[key]
        return live.get(key) if live is not None else None

    async for msg in messages:
        if "replica" in msg:
            batch.mark_routed(msg["replica"])
            if msg.get("attached"):
                return msg.get("stream")
            batch.stream_id = msg.get("stream")
            if on_routed is not None:
                on_routed(batch.requests)
            continue
        now = time.monotonic()
        later = []  # first tokens are handed out first: their handlers run (and write) first
        for key, index, token_ids, finish, logprobs in msg.get("t", ()):
            r = find(key)
            if r is None:
                continue
            event = (r, ("t", index, token_ids, finish, logprobs))
            if r.first_output_at is None:
                r.first_output_at = now
                r.events.put_nowait(event)
            else:
                later.append(event)
        for event in later:
            event[0].events.put_nowait(event)
        for kind, parts in (("done", msg.get("done", ())), ("err", msg.get("err", ()))):
            for key, a, b in parts:
                r = find(key)
                if r is None:
                    continue
                r.finished = True
                r.events.put_nowait((r, (kind, a, b)))
                if live is not None:
                    live.pop(r.request_id, None)
    return None


def fail_unfinished(batch: Batch, status: int, message: str) -> None:
    """End every request of a batch the Worker will not finish (its call failed)."""
    batch.mark_routed(None)
    for r in batch.requests:
        if not r.finished:
            r.finished = True
            r.events.put_nowait((r, ("err", status, message)))
