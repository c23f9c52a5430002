"""Shared streams, without a Ray cluster: a batch routed to a replica that already streams for
this Router joins that stream, and its tokens come through it; the join's answer may arrive
before the stream's first message, and a stream that never opens here is a 503."""

from __future__ import annotations

import asyncio

from engine.core.sampling_params import SamplingParams
from serve_app.router.batch import Batch, EngineRequest
from serve_app.router.worker_client import WorkerClient
from serve_app.wire import DonePart, ErrorPart, StreamAttach, TokenPart
from tests.serve.worker_scripts import GatedStream, ScriptedHandle, queued, step


def _peek(r: EngineRequest) -> int:
    return r.events.qsize()


def test_a_batch_joins_the_open_stream_and_its_tokens_come_through_it():
    async def run():
        gate: asyncio.Queue = asyncio.Queue()
        a = EngineRequest([1, 2], SamplingParams(max_tokens=2))
        b = EngineRequest([3], SamplingParams(max_tokens=1))
        stream = [StreamAttach("r1", "s1", False),
                  step([(a.request_id, 0, [7], None, None)]),
                  # b joined: its tokens and end come on a's stream, keyed by request id
                  step([(b.request_id, 0, [9], "length", None),
                         (a.request_id, 0, [8], "length", None)], done=[(b.request_id, 1, 0)]),
                  step(done=[(a.request_id, 2, 0)])]
        handle = ScriptedHandle(GatedStream(stream, gate), [StreamAttach("r1", "s1", True)])
        client = WorkerClient(handle)
        first, second = Batch([a]), Batch([b])
        first.task = asyncio.ensure_future(client.run_batch(first))
        gate.put_nowait(1)
        gate.put_nowait(1)  # the stream opens and a gets a token
        while _peek(a) < 1:
            await asyncio.sleep(0.001)
        second.task = asyncio.ensure_future(client.run_batch(second))
        await second.task  # the join answer ends the second call at once
        assert b.batch is first and first.requests == [a, b] and b.replica == "r1"
        for _ in range(2):
            gate.put_nowait(1)
        await first.task
        keys = handle.stream_keys
        assert keys[0] == keys[1] is not None  # both calls name this client's stream
        assert queued(b) == [TokenPart(b.request_id, 0, [9], "length", None),
                              DonePart(b.request_id, 1, 0)]
        assert queued(a) == [TokenPart(a.request_id, 0, [7], None, None),
                              TokenPart(a.request_id, 0, [8], "length", None),
                              DonePart(a.request_id, 2, 0)]
        assert client._live == {} and client._open == {}

    asyncio.run(run())


def test_a_join_answered_before_the_stream_opens_here_waits_for_it():
    # the join's answer and the open stream's first message travel in two calls: the join
    # can be heard first, and then waits (on a future, no polling) for the stream to open
    async def run():
        gate: asyncio.Queue = asyncio.Queue()
        a = EngineRequest([1, 2], SamplingParams(max_tokens=1))
        b = EngineRequest([3], SamplingParams(max_tokens=1))
        stream = [StreamAttach("r1", "s1", False),
                  step([(b.request_id, 0, [9], "length", None),
                         (a.request_id, 0, [8], "length", None)],
                        done=[(b.request_id, 1, 0), (a.request_id, 2, 0)])]
        handle = ScriptedHandle(GatedStream(stream, gate), [StreamAttach("r1", "s1", True)])
        client = WorkerClient(handle)
        first, second = Batch([a]), Batch([b])
        first.task = asyncio.ensure_future(client.run_batch(first))
        second.task = asyncio.ensure_future(client.run_batch(second))
        await asyncio.sleep(0.05)
        assert not second.task.done() and b.batch is second  # waiting for s1 to open here
        assert client._opening.keys() == {"s1"}
        gate.put_nowait(1)  # s1 opens: the join completes at once
        await asyncio.wait_for(second.task, 1.0)
        assert b.batch is first and first.requests == [a, b] and client._opening == {}
        gate.put_nowait(1)
        await first.task
        assert queued(b) == [TokenPart(b.request_id, 0, [9], "length", None),
                              DonePart(b.request_id, 1, 0)]
        assert queued(a) == [TokenPart(a.request_id, 0, [8], "length", None),
                              DonePart(a.request_id, 2, 0)]

    asyncio.run(run())


def test_a_join_to_a_stream_that_never_opens_here_is_a_503(monkeypatch):
    from serve_app.router import worker_client

    monkeypatch.setattr(worker_client, "CONTROL_TIMEOUT_S", 0.05)

    async def run():
        b = EngineRequest([3], SamplingParams(max_tokens=1))
        client = WorkerClient(ScriptedHandle([StreamAttach("r1", "s9", True)]))
        await asyncio.wait_for(client.run_batch(Batch([b])), 1.0)
        assert client._opening == {} and client._live == {}
        return b

    b = asyncio.run(run())
    assert b.routed.is_set() and b.replica == "r1"
    assert queued(b) == [ErrorPart(b.request_id, 503,
                                    "the Worker stream was lost; retry the request")]
