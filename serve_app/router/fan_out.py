"""A batch's Worker messages, handed to its requests: ``fan_out`` reads one ``generate_batch``
call's ``serve_app.wire`` messages and puts each part on its request's queue
(``EngineRequest.events``); ``fail_unfinished`` ends the requests a failed call leaves."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from serve_app import wire
from serve_app.router.batch import Batch, EngineRequest


async def fan_out(batch: Batch, messages: AsyncIterator[wire.WorkerMessage],
                  on_opened: Callable[[Batch], None] | None = None,
                  live: dict[str, EngineRequest] | None = None) -> str | None:
    """Route each Worker message's parts to the requests' queues.

    Parts name their request by position in the batch, or by request id, looked up in
    ``live`` (a stream shared by several batches; finished requests leave ``live``).
    ``on_opened`` sees the batch once its call opened a stream (to abort requests already gone,
    and to let later batches join). Returns the stream's id when the batch joined an open
    stream there (its call then ends at once and the stream's own ``fan_out`` carries the
    requests), else None when the stream ended.
    """
    def find(key: int | str) -> EngineRequest | None:
        if isinstance(key, int):
            return batch.requests[key]
        return live.get(key) if live is not None else None

    async for msg in messages:
        if isinstance(msg, wire.StreamAttach):
            batch.mark_routed(msg.replica)
            if msg.attached:
                return msg.stream
            batch.open_stream(msg.stream)
            if on_opened is not None:
                on_opened(batch)
            continue
        _deliver(msg, find, live)
    return None


def _deliver(msg: wire.StepMessage, find: Callable[[int | str], EngineRequest | None],
             live: dict[str, EngineRequest] | None) -> None:
    """One step's parts to their requests; first tokens are handed out first, so that their
    handlers run (and write) first."""
    now = time.monotonic()
    later = []
    for part in msg.tokens:
        r = find(part.key)
        if r is None:
            continue
        if r.note_output(now):
            r.put(part)
        else:
            later.append((r, part))
    for r, part in later:
        r.put(part)
    ends: list[wire.DonePart | wire.ErrorPart] = [*msg.done, *msg.errors]
    for end in ends:
        r = find(end.key)
        if r is None:
            continue
        r.finish(end)
        if live is not None:
            live.pop(r.request_id, None)


def fail_unfinished(requests: list[EngineRequest], status: int, message: str) -> None:
    """End every request the Worker will not finish (their call failed or was cancelled)."""
    for r in requests:
        r.fail(status, message)
