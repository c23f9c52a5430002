"""Scripted Worker streams and handles for the ``WorkerClient`` tests: each
``generate_batch`` call is answered with the next script (``serve_app.wire`` messages, then maybe
an exception)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from serve_app.router.batch import EngineRequest
from serve_app.wire import DonePart, Part, StepMessage, TokenPart


class ScriptedStream:
    """A scripted ``generate_batch`` stream: messages, then maybe an exception."""

    def __init__(self, script: list) -> None:
        self.script = script

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        pass


class ScriptedHandle:
    """Answers each ``generate_batch`` call with the next script (or ready-made stream)."""

    def __init__(self, *scripts: list | ScriptedStream) -> None:
        self.scripts = list(scripts)
        self.batches: list[list[str]] = []
        self.avoided: list[str | None] = []
        self.stream_keys: list[str | None] = []

    def options(self, **_):
        return self

    @property
    def generate_batch(self):
        def remote(requests, prefix_hashes=None, avoid_replica=None, stream_key=None):
            self.batches.append([r.request_id for r in requests])
            self.avoided.append(avoid_replica)
            self.stream_keys.append(stream_key)
            script = self.scripts.pop(0)
            return script if isinstance(script, ScriptedStream) else ScriptedStream(script)

        return SimpleNamespace(remote=remote)


def step(tokens=(), done=()) -> StepMessage:
    """A step message of ``TokenPart`` and ``DonePart`` fields."""
    return StepMessage([TokenPart(*t) for t in tokens], [DonePart(*d) for d in done], [])


def queued(r: EngineRequest) -> list[Part]:
    """The parts queued for ``r`` so far (taken off its queue)."""
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait()[1])
    return out


class GatedStream(ScriptedStream):
    """A stream whose messages wait for the test to release them one by one."""

    def __init__(self, script: list, gate: asyncio.Queue) -> None:
        super().__init__(script)
        self.gate = gate

    async def _run(self):
        for item in self.script:
            await self.gate.get()
            if isinstance(item, BaseException):
                raise item
            yield item
