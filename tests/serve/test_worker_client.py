"""The Router's ``WorkerClient`` without a Ray cluster, against scripted Worker streams.

* Each Worker message's parts reach their requests (``fan_out``).
* Leaving early aborts a request at its replica, or drops a batch not at a Worker yet.
* A batch whose Worker dies is retried once, on another Worker, for the requests that have
  no output yet; the others get a 503, and so does everything after a second failure or another
  kind of error.

Shared streams are ``test_shared_streams.py``'s.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.exceptions import ActorDiedError

from engine.core.sampling_params import SamplingParams
from serve_app.router.batch import Batch, EngineRequest
from serve_app.router.worker_client import WorkerClient, fan_out
from serve_app.wire import DonePart, ErrorPart, StepMessage, StreamAttach, TokenPart
from tests.serve.worker_scripts import ScriptedHandle, queued, step


def _req(n_tokens: int = 4) -> EngineRequest:
    return EngineRequest(list(range(n_tokens)), SamplingParams(max_tokens=2))


def test_fan_out_routes_step_messages_to_requests():
    async def run():
        reqs = [_req(), _req()]
        batch = Batch(reqs)

        async def messages():
            yield StreamAttach("r1", "s1", attached=False)
            yield StepMessage([TokenPart(0, 0, [5], None, None),
                               TokenPart(1, 0, [6, 7], "length", None)], [DonePart(1, 4, 0)], [])
            yield StepMessage([TokenPart(0, 0, [8], "stop", None)], [DonePart(0, 4, 0)], [])

        await fan_out(batch, messages())
        assert all(r.replica == "r1" and r.finished for r in reqs)
        assert batch.stream_id == "s1"
        got0 = [reqs[0].events.get_nowait()[1] for _ in range(3)]
        assert got0 == [TokenPart(0, 0, [5], None, None), TokenPart(0, 0, [8], "stop", None),
                        DonePart(0, 4, 0)]
        assert reqs[1].events.get_nowait()[1] == TokenPart(1, 0, [6, 7], "length", None)

    asyncio.run(run())


# ---- leaving early ----------------------------------------------------------------------------

class _FakeCall:
    def __init__(self, log, name, kwargs):
        log.append((name, kwargs))

    def __await__(self):
        return asyncio.sleep(0, result=1).__await__()

    def cancel(self):
        pass


class _FakeHandle:
    def __init__(self):
        self.calls: list = []

    def options(self, **_):
        return self

    def __getattr__(self, name):
        log = self.calls
        return SimpleNamespace(remote=lambda **kw: _FakeCall(log, name, kw))


def test_leaving_early_aborts_at_the_replica_or_cancels_the_batch():
    """A routed request is aborted at its replica (its stream may carry other batches'
    requests, so the call is never cancelled for it); a batch not at a Worker yet whose
    clients all left is dropped by cancelling its call."""
    from serve_app.router.worker_client import WorkerClient

    async def run():
        handle = _FakeHandle()
        client = WorkerClient(handle)
        a, b = _req(), _req()
        batch = Batch([a, b], task=asyncio.get_running_loop().create_task(asyncio.sleep(10)))
        batch.mark_routed("rep-7")
        assert a.batch is b.batch is batch and a.replica == b.replica == "rep-7"
        client.release(a)
        client.release(b, "stop")  # its text hit a stop string: the Worker counts a stop
        await asyncio.sleep(0.01)
        assert handle.calls == [
            ("abort", {"request_ids": [a.request_id], "reason": "abort",
                       "target_replica": "rep-7"}),
            ("abort", {"request_ids": [b.request_id], "reason": "stop",
                       "target_replica": "rep-7"})]
        assert not batch.task.done()
        c, d = _req(), _req()
        unrouted = Batch([c, d], task=asyncio.get_running_loop().create_task(asyncio.sleep(10)))
        client.release(c)  # d still listens: nothing to do yet
        await asyncio.sleep(0)
        assert not unrouted.task.done()
        client.release(d)  # nobody listens and nothing reached a Worker: drop the call
        await asyncio.sleep(0)
        assert unrouted.task.cancelled() and len(handle.calls) == 2
        batch.task.cancel()

    asyncio.run(run())


# ---- a dead Worker's batch --------------------------------------------------------------------

def _run_batch(*scripts: list) -> tuple[ScriptedHandle, EngineRequest, EngineRequest]:
    async def run():
        handle = ScriptedHandle(*scripts)
        a = EngineRequest([1, 2], SamplingParams(max_tokens=1))
        b = EngineRequest([3, 4], SamplingParams(max_tokens=1))
        batch = Batch([a, b])
        await WorkerClient(handle).run_batch(batch)
        return handle, a, b

    return asyncio.run(run())


def test_dead_worker_retries_only_requests_without_output():
    first = [StreamAttach("r1", "s1", False), step([(0, 0, [7], None, None)]),
             ActorDiedError()]
    second = [StreamAttach("r2", "s2", False), step([(0, 0, [9], "length", None)]),
              step(done=[(0, 2, 0)])]
    handle, a, b = _run_batch(first, second)
    assert handle.batches == [[a.request_id, b.request_id], [b.request_id]]
    assert handle.avoided == [None, "r1"]  # the retry names the dead replica
    assert queued(a) == [TokenPart(0, 0, [7], None, None),
                          ErrorPart(a.request_id, 503, "Worker unavailable: ActorDiedError")]
    assert queued(b) == [TokenPart(0, 0, [9], "length", None), DonePart(0, 2, 0)]
    assert b.replica == "r2" and b.batch.attempt == 1


def test_a_second_death_or_another_error_is_a_503():
    handle, a, b = _run_batch([StreamAttach("r1", "s1", False), ActorDiedError()],
                              [StreamAttach("r2", "s2", False), ActorDiedError()])
    assert len(handle.batches) == 2  # one retry, not more
    assert [(type(e), e[1]) for e in queued(a) + queued(b)] == [(ErrorPart, 503)] * 2
    handle, a, b = _run_batch([StreamAttach("r1", "s1", False), RuntimeError("boom")])
    assert len(handle.batches) == 1  # not a dead replica: no retry
    assert [(type(e), e[1]) for e in queued(a) + queued(b)] == [(ErrorPart, 503)] * 2


def test_the_batcher_hears_once_when_a_retried_batch_is_routed():
    # the batcher holds new requests while a batch is on its way: a batch whose Worker died
    # before answering is on its way until its retry is routed, and is reported once
    async def run():
        heard: list[tuple] = []  # (replica, events already out) when the batcher hears
        handle = ScriptedHandle([ActorDiedError()],
                         [StreamAttach("r2", "s2", False), step([(0, 0, [9], "length", None)]),
                          step(done=[(0, 2, 0)])])
        a = EngineRequest([1, 2], SamplingParams(max_tokens=1))
        batch = Batch([a], on_routed=lambda: heard.append((a.replica, a.events.qsize())))
        await WorkerClient(handle).run_batch(batch)
        batch.routed_or_over()  # the call's end (the batcher's task callback) adds nothing
        return heard, a

    heard, a = asyncio.run(run())
    assert heard == [("r2", 0)]  # at the retry's answer, before its tokens
    assert queued(a) == [TokenPart(0, 0, [9], "length", None), DonePart(0, 2, 0)]
