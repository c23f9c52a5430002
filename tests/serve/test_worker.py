"""The Worker without Ray Serve: a real ``AsyncEngine`` on a small checkpoint, given to the
Worker through ``engine_factory``, answering batches, aborts, joins and reports; a stalled
engine's 503s and failed health check; and the Router's vocabulary bound, which is the
engine's (``model_info()["vocab_size"]``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import SamplingParams
from serve_app.config import AppConfig
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import CompletionRequest, parse_request
from serve_app.router.prompts import PromptProcessor
from serve_app.wire import DonePart, ErrorPart, StepMessage, StreamAttach, WorkerRequest
from serve_app.worker.worker import Worker
from tests.checkpoints import make_checkpoint
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)

pytestmark = pytest.mark.usefixtures("recorded")


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> AppConfig:
    # config.json's vocab_size (768) is larger than the tokenizer's: ids in between have
    # embedding rows but no text
    path = make_checkpoint(tmp_path_factory.mktemp("llama"))
    return AppConfig(model=str(path), dtype="float32", max_model_len=128, block_size=8,
                     kv_cache_memory_bytes=4 << 20, num_threads=1, accelerator="cpu")


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          detokenize=False, output_kind="delta")


def _run(config: AppConfig, test, engine_cfg=None) -> None:
    """Run ``test(worker)`` on a Worker whose engine is an ``AsyncEngine`` of ``config`` (or of
    ``engine_cfg``)."""
    async def main() -> None:
        worker = Worker(config, engine_factory=lambda cfg: AsyncEngine(engine_cfg or cfg.engine),
                        replica_id="w1")
        try:
            await test(worker)
        finally:
            worker.engine.shutdown()

    asyncio.run(main())


def _tokens(messages: list) -> dict:
    """Each key's token ids, end to end, over a stream's step messages."""
    out: dict = {}
    for m in messages:
        if isinstance(m, StepMessage):
            for t in m.tokens:
                out.setdefault(t.key, []).extend(t.token_ids)
    return out


def _ends(messages: list) -> list:
    return [p for m in messages if isinstance(m, StepMessage) for p in (*m.done, *m.errors)]


async def _idle(worker: Worker) -> None:
    deadline = time.monotonic() + 10
    while worker.engine.get_stats()["num_running"] and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


def test_a_batch_streams_what_the_engine_generates(config):
    async def test(worker: Worker) -> None:
        batch = [WorkerRequest("a", [0, 5, 9, 12], _params(4)),
                 WorkerRequest("b", [0, 7], _params(2))]
        messages = [m async for m in worker.generate_batch(batch)]
        assert isinstance(messages[0], StreamAttach)
        assert (messages[0].replica, messages[0].attached) == ("w1", False)
        alone = {}
        for key, req in enumerate(batch):  # the same prompts straight through the engine
            outs = worker.engine.generate(f"ref-{key}", req.prompt_token_ids, req.params)
            alone[key] = [t async for o in outs for t in o.outputs[0].token_ids]
        assert _tokens(messages) == alone and [len(alone[0]), len(alone[1])] == [4, 2]
        assert sorted(_ends(messages)) == [DonePart(0, 4, 0), DonePart(1, 2, 0)]
        await _idle(worker)
        stats = await worker.get_stats()
        assert (stats["replica"], stats["requests_total"], stats["batches_total"],
                stats["batches_running"], stats["aborted_total"]) == ("w1", 2, 1, 0, 0)
        routing = worker.record_routing_stats()
        assert (routing["num_running"], routing["num_waiting"], routing["received"]) == \
            (0, 0, {"": 2})
        scaling = worker.record_autoscaling_stats()
        assert (scaling["num_running"], scaling["seq_slot_usage"]) == (0.0, 0.0)
        worker.check_health()

    _run(config, test)


def test_an_abort_ends_a_request_and_a_batch_joins_the_open_stream(config):
    async def test(worker: Worker) -> None:
        stream = worker.generate_batch([WorkerRequest("long", [0, 3], _params(100))],
                                       stream_key="router-1")
        opened = await stream.__anext__()
        first_step = await stream.__anext__()
        assert "long" in _tokens([first_step])
        join = [m async for m in worker.generate_batch(
            [WorkerRequest("short", [0, 4], _params(3))], stream_key="router-1")]
        assert join == [StreamAttach("w1", opened.stream, attached=True)]
        assert await worker.abort(["long"]) == 1
        rest = [first_step] + [m async for m in stream]
        tokens, ends = _tokens(rest), {e.key: e for e in _ends(rest)}
        assert len(tokens["short"]) == 3 and 0 < len(tokens["long"]) < 100
        assert ends["short"] == DonePart("short", 2, 0)
        assert isinstance(ends["long"], DonePart) and ends["long"].num_prompt_tokens == 2
        assert len(_ends(rest)) == 2
        assert (await worker.get_stats())["aborted_total"] == 1
        assert worker.record_routing_stats()["received"] == {"router-1": 2}

    _run(config, test)


def test_the_router_and_the_engine_bound_token_ids_by_the_same_vocabulary(config):
    async def test(worker: Worker) -> None:
        info = await worker.model_info()
        tokenizer_size, vocab = len(info["tokenizer"]), info["vocab_size"]
        assert vocab == worker.engine.vocab_size == 768 > tokenizer_size
        p = PromptProcessor(info, "m", 16)
        assert p.encode_completion([0, tokenizer_size, vocab - 1]) == [0, tokenizer_size,
                                                                          vocab - 1]
        with pytest.raises(APIError) as err:
            p.encode_completion([0, vocab])
        assert (err.value.status, err.value.param) == (400, "prompt")
        req = parse_request(CompletionRequest,
                            f'{{"prompt": [0], "stop_token_ids": [{vocab - 1}]}}'.encode())
        assert p.params(req, [0], 2, None).stop_token_ids == [vocab - 1]
        req = parse_request(CompletionRequest,
                            f'{{"prompt": [0], "stop_token_ids": [{vocab}]}}'.encode())
        with pytest.raises(APIError) as err:
            p.params(req, [0], 2, None)
        assert (err.value.status, err.value.param) == (400, "stop_token_ids")
        # the engine draws the same line: the edge ids run, the next one is a 400 there too
        batch = [WorkerRequest("in", [0, tokenizer_size, vocab - 1], _params(2)),
                 WorkerRequest("out", [0, vocab], _params(2))]
        messages = [m async for m in worker.generate_batch(batch)]
        assert len(_tokens(messages)[0]) == 2
        (error,) = [e for e in _ends(messages) if isinstance(e, ErrorPart)]
        assert (error.key, error.status) == (1, 400) and "token ids" in error.message
        assert DonePart(0, 3, 0) in _ends(messages)

    _run(config, test)


def test_stop_string_aborts_count_as_stops_and_cache_info(config, recorded):  # noqa: F811
    """The Router aborts a request whose text hit a stop string with reason "stop": the real
    engine's request ends, and the Worker's metrics count it as a stop; one aborted because its
    client left counts as an abort. ``cache_config_info`` says the KV cache's settings."""
    from tests.serve.test_worker_metrics import _full

    async def test(worker: Worker) -> None:
        for rid, reason in (("a", "stop"), ("b", "abort")):
            stream = worker.generate_batch([WorkerRequest(rid, [0, 3], _params(100))])
            await stream.__anext__()
            await stream.__anext__()  # a first step: it is running
            assert await worker.abort([rid], reason) == 1
            assert isinstance(_ends([m async for m in stream])[-1], DonePart)
        await _idle(worker)
        reasons = [tags["finished_reason"]
                   for _, tags in recorded[_full("request_success_total")].calls]
        assert reasons == ["stop", "abort"]
        (value, tags), = recorded[_full("cache_config_info")].calls
        num_blocks = str(worker.engine.get_stats()["num_total_blocks"])
        assert value == 1.0 and tags == {"model_name": str(config.engine.model.model),
                                         "replica": "w1", "block_size": "8",
                                         "num_gpu_blocks": num_blocks,
                                         "cache_dtype": "float32",
                                         "enable_prefix_caching": "True"}

    _run(config, test)


def test_a_stalled_engine_answers_503_fails_its_health_check_and_refuses_new_batches(
        config, monkeypatch):
    """A step hung past ``step_timeout_s``: the open request ends with a 503 naming the stall,
    which the Router's stream turns into OpenAI's 503 body; ``check_health`` (Serve's probe)
    raises the same message, its routing report says ``stopped``, and a new batch is refused at
    once, not queued."""
    from engine.health import EngineStalledError
    from serve_app.router.batch import Batch, EngineRequest
    from serve_app.router.streams import ResponseStream
    from serve_app.router.worker_client import fan_out
    from tests.engine.test_step_watchdog import STALL, Hang

    engine_cfg = config.engine.model_copy(deep=True)
    engine_cfg.scheduler.step_timeout_s = 0.5

    async def test(worker: Worker) -> None:
        hang = Hang(worker.engine, monkeypatch)
        hang.hold.set()
        try:
            routed = EngineRequest([0, 5, 9], _params(4))
            stream = worker.generate_batch([routed.wire()])
            await asyncio.wait_for(fan_out(Batch([routed]), stream), 10)
            assert routed.finished
            with pytest.raises(APIError) as err:  # the Worker's ErrorPart, as the Router reads it
                await anext(ResponseStream([routed], worker.engine.tokenizer, [], False, True,
                                           None, lambda r, reason: None).deltas())
            body = err.value.body()["error"]
            assert (err.value.status, body["type"]) == (503, "service_unavailable_error")
            assert STALL.fullmatch(body["message"])
            with pytest.raises(EngineStalledError, match=STALL):
                worker.check_health()
            assert worker.record_routing_stats()["stopped"]  # routed to last from now on
            start = time.monotonic()
            late = [m async for m in worker.generate_batch(
                [WorkerRequest("late", [0, 7], _params(2))])]
            assert time.monotonic() - start < 1.0  # refused, not queued behind the stuck step
            (refused,) = _ends(late)
            assert refused.status == 503 and STALL.fullmatch(refused.message)
        finally:
            hang.hold.clear()

    _run(config, test, engine_cfg)

