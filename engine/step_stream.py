"""One consumer's view of the step loop: ``StepStream``, one ``StepOutputs`` per engine step.

A consumer (a Worker's batch, or one ``AsyncEngine.generate`` call) opens a stream for a set of
requests (``AsyncEngine.add_batch``) and may add more to it (``StepStream.add``). The loop
thread collects, per consumer, everything one iteration (the inbox, then the step) produced
for that consumer's requests: their outputs and their failures, in one ``StepOutputs``. It
hands them over with one thread-safe callback per event loop (``Outbox.flush``), so a step
reaches its consumer whole, as one record, whatever else that event loop runs meanwhile: as
vLLM's engine core hands each client its outputs per step.

A request's stream ends with its finished output, its failure, or its abort by the consumer
(``StepStream.abort``, reported in a record of its own). Iteration ends once no request is
open and every record has been taken. Closing the stream aborts what is still open.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from engine.core.outputs import RequestOutput

if TYPE_CHECKING:
    from engine.core.sampling_params import SamplingParams
    from engine.tokenizer import PromptType

# What a consumer asks for: (request id, prompt, sampling parameters).
StepRequest = tuple[str, "PromptType", "SamplingParams"]


@dataclass
class StepOutputs:
    """What one engine step (or the consumer's own aborts) did to one consumer's requests."""

    # One per request that the step advanced, in the engine's order; ``finished`` ends it.
    outputs: list[RequestOutput] = field(default_factory=list)
    # Requests that failed, and why: ``ValueError`` (bad input), ``EngineDeadError`` (the
    # engine stopped; ``EngineStalledError``: a step outlived its bound), or what processing
    # that request raised. Each ends its request.
    failed: list[tuple[str, BaseException]] = field(default_factory=list)
    # Requests the consumer aborted (``StepStream.abort``): ended, nothing more comes for them.
    aborted: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.failed or self.aborted)


class StepSource(Protocol):
    """The engine side of a stream (``AsyncEngine``)."""

    def subscribe(self, stream: StepStream, request: StepRequest) -> BaseException | None:
        """Route ``request``'s outputs to ``stream`` and queue it; or say why it cannot run."""
        ...

    def unsubscribe(self, stream: StepStream, request_ids: Iterable[str], abort: bool) -> None:
        """Stop routing the requests to ``stream`` (and abort them in the engine)."""
        ...


class StepStream:
    """A consumer's requests; iterate it for one ``StepOutputs`` per step that touched them.

    Used from the event loop that opened it only."""

    def __init__(self, source: StepSource, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._source = source
        self._open: set[str] = set()  # requests not ended yet
        self._records: collections.deque[StepOutputs] = collections.deque()
        self._ready = asyncio.Event()
        self._closed = False

    @property
    def open(self) -> frozenset[str]:
        """The requests that have not ended yet (as far as the records taken and queued say)."""
        return frozenset(self._open)

    def add(self, requests: Iterable[StepRequest]) -> None:
        """Queue requests in the engine, their outputs to come here. One the engine refuses (a
        reused id, a stopped engine) comes back as a failure in the next record."""
        failed = []
        for request in requests:
            err = self._source.subscribe(self, request)
            if err is None:
                self._open.add(request[0])
            else:
                failed.append((request[0], err))
        if failed:
            self._push(StepOutputs(failed=failed))

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort open requests; returns those that were open. The next record says so."""
        aborted = [rid for rid in dict.fromkeys(request_ids) if rid in self._open]
        if aborted:
            self._open.difference_update(aborted)
            self._source.unsubscribe(self, aborted, abort=True)
            self._push(StepOutputs(aborted=aborted))
        return aborted

    def close(self) -> None:
        """Abort every open request and stop receiving (idempotent)."""
        self._closed = True
        self._records.clear()
        if self._open:
            self._source.unsubscribe(self, list(self._open), abort=True)
            self._open.clear()

    def __aiter__(self) -> StepStream:
        return self

    async def __anext__(self) -> StepOutputs:
        while not self._records:
            if not self._open or self._closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._records.popleft()

    def receive(self, record: StepOutputs) -> None:
        """A record from the loop thread (on this stream's event loop): keep what concerns its
        open requests, and let the ended ones go."""
        if self._closed:
            return
        outputs = [o for o in record.outputs if o.request_id in self._open]
        ended = {o.request_id for o in outputs if o.finished}
        failed = [(rid, e) for rid, e in record.failed if rid in self._open and rid not in ended]
        ended.update(rid for rid, _ in failed)
        if ended:
            self._open.difference_update(ended)
            self._source.unsubscribe(self, ended, abort=False)
        self._push(StepOutputs(outputs, failed))

    def _push(self, record: StepOutputs) -> None:
        if record:
            self._records.append(record)
            self._ready.set()


class Subscribers:
    """Which stream each request reports to: streams change it from their event loops, the
    loop thread reads it (each change and read is one dict operation)."""

    def __init__(self) -> None:
        self._streams: dict[str, StepStream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def add(self, stream: StepStream, request_id: str) -> ValueError | None:
        if request_id in self._streams:
            return ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = stream
        return None

    def remove(self, stream: StepStream, request_ids: Iterable[str]) -> list[str]:
        """Those of ``request_ids`` that reported to ``stream``, which they no longer do."""
        removed = [rid for rid in request_ids if self._streams.get(rid) is stream]
        for rid in removed:
            del self._streams[rid]
        return removed

    def outbox(self) -> Outbox:
        return Outbox(self._streams)

    def fail_all(self, err: BaseException) -> None:
        """Every open request fails with ``err``, at once (the engine stopped or stalled)."""
        outbox = self.outbox()
        outbox.fail(list(self._streams), err)
        outbox.flush()


class Outbox:
    """The loop thread's records of one iteration, one per stream, until ``flush``."""

    def __init__(self, streams: dict[str, StepStream]) -> None:
        self._streams = streams
        self._records: dict[StepStream, StepOutputs] = {}

    def output(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            self._records.setdefault(stream, StepOutputs()).outputs.append(out)

    def fail(self, request_ids: Iterable[str], err: BaseException) -> None:
        """Every way a request fails goes through here: its stream's record carries ``err``."""
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                self._records.setdefault(stream, StepOutputs()).failed.append((rid, err))
    def flush(self) -> None:
        """Hand every record to its stream: one thread-safe callback per event loop (each costs
        that loop a wake-up), which gives each stream its record whole."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[StepStream, StepOutputs]]] = {}
        for stream, record in self._records.items():
            by_loop.setdefault(stream.loop, []).append((stream, record))
        self._records = {}
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_receive_all, items)
            except RuntimeError:  # that loop has closed: nobody listens there any more
                pass


def _receive_all(items: list[tuple[StepStream, StepOutputs]]) -> None:
    for stream, record in items:
        stream.receive(record)
