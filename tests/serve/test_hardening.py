"""Bounds on one request, and a dead Worker's batch, without a Ray cluster.

* ``n``, ``max_tokens``, the number of prompts, ``seed`` and ``stop_token_ids`` are bounded
  before a request reaches a Worker (400 naming the field), so one request can neither take
  every KV block nor break an engine step that other requests share.
* A batch whose Worker dies is retried once, on another Worker, for the requests that have
  no output yet; the others get a 503, and so does everything after a second failure or another
  kind of error.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from engine.sampling_params import SamplingParams
from serve_app.batcher import Batch, EngineRequest
from serve_app.errors import APIError
from serve_app.prompts import PromptProcessor
from serve_app.protocol import CompletionRequest, parse_request
from serve_app.worker_client import WorkerClient


class _Tokenizer:
    def __len__(self) -> int:
        return 100

    def __call__(self, text: str, **_):
        return SimpleNamespace(input_ids=[5] * len(text.split()))


def _processor(**kw) -> PromptProcessor:
    info = {"tokenizer": _Tokenizer(), "max_model_len": 64}
    return PromptProcessor(info, "m", 16, **kw)


@pytest.mark.parametrize("num_prompts, n, max_tokens, param", [
    (1, 5, 8, "n"), (1, 1, 33, "max_tokens"), (9, 1, 8, "prompt"),
    (3, 4, 8, "prompt")])  # 12 sequences: the bound counts prompts x n, not prompts
def test_request_size_bounds_are_400(num_prompts, n, max_tokens, param):
    p = _processor(max_n=4, max_tokens_limit=32, max_prompts=8)
    p.check_size(8, 1, 32)  # at the bounds: accepted
    p.check_size(2, 4, 32)
    with pytest.raises(APIError) as err:
        p.check_size(num_prompts, n, max_tokens)
    assert err.value.status == 400 and err.value.param == param


def test_max_tokens_limit_caps_the_default():
    req = parse_request(CompletionRequest, b'{"prompt": "a b c"}')
    assert _processor().params(req, [5] * 3, None, None).max_tokens == 61
    assert _processor(max_tokens_limit=20).params(req, [5] * 3, None, None).max_tokens == 20


def test_stop_token_ids_outside_the_vocabulary_are_400():
    req = parse_request(CompletionRequest, b'{"prompt": "a", "stop_token_ids": [3, 100]}')
    with pytest.raises(APIError) as err:
        _processor().params(req, [5], 4, None)
    assert err.value.status == 400 and err.value.param == "stop_token_ids"


@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1, 2 ** 70])
def test_seed_must_fit_in_int64(seed):
    with pytest.raises(APIError) as err:
        parse_request(CompletionRequest, f'{{"prompt": "a", "seed": {seed}}}'.encode())
    assert err.value.param == "seed"
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    SamplingParams(seed=2 ** 63 - 1)
    SamplingParams(seed=-(2 ** 63))


# ---- a dead Worker's batch ---------------------------------------------------------------------

class _Stream:
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


class _Handle:
    """Answers each ``generate_batch`` call with the next script (or ready-made stream)."""

    def __init__(self, *scripts: list | _Stream) -> None:
        self.scripts = list(scripts)
        self.batches: list[list[str]] = []
        self.avoided: list[str | None] = []
        self.stream_keys: list[str | None] = []

    def options(self, **_):
        return self

    @property
    def generate_batch(self):
        def remote(requests, prefix_hashes=None, avoid_replica=None, stream_key=None):
            self.batches.append([r[0] for r in requests])
            self.avoided.append(avoid_replica)
            self.stream_keys.append(stream_key)
            script = self.scripts.pop(0)
            return script if isinstance(script, _Stream) else _Stream(script)

        return SimpleNamespace(remote=remote)


def _events(r: EngineRequest) -> list[tuple]:
    out = []
    while not r.events.empty():
        out.append(r.events.get_nowait()[1])
    return out


def _run_batch(*scripts: list) -> tuple[_Handle, EngineRequest, EngineRequest]:
    async def run():
        handle = _Handle(*scripts)
        a = EngineRequest([1, 2], SamplingParams(max_tokens=1))
        b = EngineRequest([3, 4], SamplingParams(max_tokens=1))
        batch = Batch([a, b])
        a.batch = b.batch = batch
        await WorkerClient(handle).run_batch(batch)
        return handle, a, b

    return asyncio.run(run())


def test_dead_worker_retries_only_requests_without_output():
    first = [{"replica": "r1"}, {"t": [[0, 0, [7], None, None]]}, ActorDiedError()]
    second = [{"replica": "r2"}, {"t": [[0, 0, [9], "length", None]]}, {"done": [[0, 2, 0]]}]
    handle, a, b = _run_batch(first, second)
    assert handle.batches == [[a.request_id, b.request_id], [b.request_id]]
    assert handle.avoided == [None, "r1"]  # the retry names the dead replica
    assert _events(a) == [("t", 0, [7], None, None), ("err", 503,
                                                       "Worker unavailable: ActorDiedError")]
    assert _events(b) == [("t", 0, [9], "length", None), ("done", 2, 0)]
    assert b.replica == "r2" and b.batch.attempt == 1


def test_a_second_death_or_another_error_is_a_503():
    handle, a, b = _run_batch([{"replica": "r1"}, ActorDiedError()],
                              [{"replica": "r2"}, ActorDiedError()])
    assert len(handle.batches) == 2  # one retry, not more
    assert [e[:2] for e in _events(a) + _events(b)] == [("err", 503), ("err", 503)]
    handle, a, b = _run_batch([{"replica": "r1"}, RuntimeError("boom")])
    assert len(handle.batches) == 1  # not a dead replica: no retry
    assert [e[:2] for e in _events(a) + _events(b)] == [("err", 503), ("err", 503)]


def test_a_retried_batch_never_goes_back_to_the_dead_replica():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from serve_app.request_router import WorkerRequestRouter

    dep = DeploymentID(name="WorkerHardening", app_name="t")
    router = WorkerRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()

    def replica(uid: str, running: int):
        return SimpleNamespace(replica_id=ReplicaID(uid, dep), max_ongoing_requests=100,
                               routing_stats={"num_running": running, "num_waiting": 0,
                                              "num_free_blocks": 10, "num_total_blocks": 10})

    def choose(replicas, **kwargs):
        pending = SimpleNamespace(args=[], kwargs=kwargs, routing_context=SimpleNamespace())
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        return [r.replica_id.unique_id for rank in ranks for r in rank]

    dead, busy = replica("dead", 0), replica("busy", 9)
    assert choose([dead, busy], requests=[1]) == ["dead", "busy"]  # least loaded first
    assert choose([dead, busy], requests=[1], avoid_replica="dead") == ["busy"]
    assert choose([dead], requests=[1], avoid_replica="dead") == []  # wait for another one


# ---- shared streams: a batch routed to a replica already streaming for this Router joins it ---

class _GatedStream(_Stream):
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


def test_a_batch_joins_the_open_stream_and_its_tokens_come_through_it():
    async def run():
        gate: asyncio.Queue = asyncio.Queue()
        a = EngineRequest([1, 2], SamplingParams(max_tokens=2))
        b = EngineRequest([3], SamplingParams(max_tokens=1))
        stream = [{"replica": "r1", "stream": "s1", "attached": False},
                  {"t": [[a.request_id, 0, [7], None, None]]},
                  # b joined: its tokens and end come on a's stream, keyed by request id
                  {"t": [[b.request_id, 0, [9], "length", None],
                         [a.request_id, 0, [8], "length", None]],
                   "done": [[b.request_id, 1, 0]]},
                  {"done": [[a.request_id, 2, 0]]}]
        handle = _Handle(_GatedStream(stream, gate),
                         [{"replica": "r1", "stream": "s1", "attached": True}])
        client = WorkerClient(handle)
        first, second = Batch([a]), Batch([b])
        a.batch, b.batch = first, second
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
        assert _events(b) == [("t", 0, [9], "length", None), ("done", 1, 0)]
        assert _events(a) == [("t", 0, [7], None, None), ("t", 0, [8], "length", None),
                              ("done", 2, 0)]
        assert client._live == {} and client._open == {}

    asyncio.run(run())


def _peek(r: EngineRequest) -> int:
    return r.events.qsize()


def test_the_batcher_hears_once_when_a_retried_batch_is_routed():
    # the batcher holds new requests while a batch is on its way: a batch whose Worker died
    # before answering is on its way until its retry is routed, and is reported once
    async def run():
        heard: list[tuple] = []  # (replica, events already out) when the batcher hears
        handle = _Handle([ActorDiedError()],
                         [{"replica": "r2"}, {"t": [[0, 0, [9], "length", None]]},
                          {"done": [[0, 2, 0]]}])
        a = EngineRequest([1, 2], SamplingParams(max_tokens=1))
        batch = Batch([a], on_routed=lambda: heard.append((a.replica, a.events.qsize())))
        a.batch = batch
        await WorkerClient(handle).run_batch(batch)
        batch.routed_or_over()  # the call's end (the batcher's task callback) adds nothing
        return heard, a

    heard, a = asyncio.run(run())
    assert heard == [("r2", 0)]  # at the retry's answer, before its tokens
    assert _events(a) == [("t", 0, [9], "length", None), ("done", 2, 0)]


# ---- no silent insecurity ----------------------------------------------------------------------

@pytest.mark.parametrize("key, message", [
    ("", "must not be empty or whitespace"), ("   ", "must not be empty or whitespace"),
    ("\t\n", "must not be empty or whitespace"), (" s3cret-key ", "must not start or end")])
def test_an_empty_or_padded_api_key_is_a_start_up_error(key, message):
    from pydantic import ValidationError

    from serve_app.config import AppConfig

    with pytest.raises(ValidationError, match=message) as err:
        AppConfig(api_key=key)
    assert "api_key" in str(err.value)
    assert "s3cret" not in str(err.value)  # the error never repeats the key
    assert AppConfig(api_key="k").resolved_api_key() == "k"


def test_admission_counts_sequences_not_prompts():
    """A prompt with ``n`` choices is ``n`` sequences against ``max_waiting_requests``: one
    request with n=16 once counted as 1 and could hold the whole engine."""
    from serve_app.router import Router

    cls = Router.func_or_class
    waiting = [EngineRequest([1, 2], SamplingParams(n=3)), EngineRequest([1], SamplingParams())]
    started = EngineRequest([1], SamplingParams(n=4))
    started.first_output_at = 1.0
    rejected = []
    router = SimpleNamespace(
        _active={*waiting, started}, _counters={"requests_total": 0, "rejected_429_total": 0},
        cfg=SimpleNamespace(max_waiting_requests=6), _ttft_ewma_s=0.0,
        metrics=SimpleNamespace(rejected=rejected.append))
    router._num_waiting = lambda: cls._num_waiting(router)
    assert router._num_waiting() == 4
    cls._admit(router, 2)  # 4 + 2 <= 6: admitted
    with pytest.raises(APIError) as err:
        cls._admit(router, 3)
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    assert rejected == ["queue_full"] and router._counters["rejected_429_total"] == 1
