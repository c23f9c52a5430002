"""The Router's dynamic batcher.

``DynamicBatcher.submit`` queues ``EngineRequest``s; a ``Batch`` is sent when
``max_batch_size`` requests wait or ``batch_wait_s`` has passed since the oldest (sooner when no
batch is on its way to a Worker, see the class). The sink that sends it (the Router's
``WorkerClient.run_batch``) streams the Worker's answer and hands each request the parts meant
for it (``serve_app.wire``). The records themselves live in ``serve_app/router/batch.py``.

This module knows nothing about HTTP or Ray, so it is tested with a fake Worker.
"""

from __future__ import annotations

import asyncio

from serve_app.router.batch import Batch, BatchSink, EngineRequest


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
