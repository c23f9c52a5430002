"""AsyncEngine: streaming, abort on cancel freeing every block, per-request failures."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncEngine, SamplingParams
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = AsyncEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    yield eng
    eng.shutdown()


def run(coro):
    return asyncio.run(coro)


async def collect(engine, rid, prompt, params):
    outs = []
    async for out in engine.generate(rid, prompt, params):
        outs.append(out)
    return outs


def test_streams_deltas_that_add_up_to_the_offline_output(engine, ckpt):
    prompts = [[0, 5, 6, 7], [0, *range(100, 140)], [0, 9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, output_kind="delta",
                            detokenize=False)

    async def main():
        return await asyncio.gather(*[collect(engine, f"s{i}", p, params)
                                      for i, p in enumerate(prompts)])

    streams = run(main())
    offline = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0,
                                                                   ignore_eos=True),
        use_tqdm=False)
    for outs, ref in zip(streams, offline):
        assert len(outs) == 12  # one output per step, one new token each
        assert [t for o in outs for t in o.outputs[0].token_ids] == ref.outputs[0].token_ids
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])


def test_cumulative_text_stream(engine):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = run(collect(engine, "text", "Hello, my name is", params))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert len(outs[-1].outputs[0].token_ids) == 6


def test_closing_the_stream_aborts_and_frees_every_block(engine):
    """Aborted, not finished: it stops generating long before its 400 tokens (a request that
    ran to its end would free its blocks too)."""
    total = engine.get_stats()["num_total_blocks"]
    generated = engine.get_stats()["generation_tokens_total"]

    async def main():
        gen = engine.generate("long", [0, *range(50, 90)],
                              SamplingParams(max_tokens=400, ignore_eos=True))
        await gen.__anext__()
        await gen.__anext__()
        busy = engine.get_stats()["num_free_blocks"]
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.get_stats()["num_free_blocks"] == total:
                break
        return busy

    busy = run(main())
    assert busy < total
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == total
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["generation_tokens_total"] - generated < 400


def test_cancelled_task_aborts(engine):
    total = engine.get_stats()["num_total_blocks"]
    generated = engine.get_stats()["generation_tokens_total"]

    async def main():
        task = asyncio.create_task(collect(engine, "cancel-me", [0, 1, 2],
                                           SamplingParams(max_tokens=500, ignore_eos=True)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.get_stats()["num_free_blocks"] == total:
                return True
        return False

    assert run(main())
    assert engine.get_stats()["generation_tokens_total"] - generated < 500


def test_bad_input_fails_only_that_request(engine):
    good = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def main():
        results = await asyncio.gather(
            collect(engine, "ok", [0, 3, 4], good),
            collect(engine, "empty", [], good),
            collect(engine, "vocab", [0, 99999], good),
            return_exceptions=True)
        with pytest.raises(ValueError, match="already in use"):
            async with asyncio.timeout(5):
                first = engine.generate("dup", [0, 1], SamplingParams(max_tokens=50))
                await first.__anext__()
                await collect(engine, "dup", [0, 1], good)
        await first.aclose()
        return results

    ok, empty, vocab = run(main())
    assert len(ok[-1].outputs[0].token_ids) == 8
    assert isinstance(empty, ValueError) and "empty" in str(empty)
    assert isinstance(vocab, ValueError) and "token ids" in str(vocab)


def test_an_error_while_processing_one_request_spares_the_others(engine, monkeypatch):
    from engine.core.detokenizer import TextStream

    original = TextStream.add

    def flaky(self, token_ids):
        if self.stop == ["BOOM"]:
            raise RuntimeError("detokenizer exploded")
        return original(self, token_ids)

    monkeypatch.setattr(TextStream, "add", flaky)

    async def main():
        return await asyncio.gather(
            collect(engine, "fine", "Hello", SamplingParams(max_tokens=8, ignore_eos=True)),
            collect(engine, "boom", "Hello", SamplingParams(max_tokens=8, stop=["BOOM"])),
            return_exceptions=True)

    fine, boom = run(main())
    assert isinstance(boom, RuntimeError) and "exploded" in str(boom)
    assert len(fine[-1].outputs[0].token_ids) == 8
    assert engine.is_running
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def test_abort_ends_an_open_stream_with_finish_reason_abort(engine):
    async def main():
        outs = []
        async for out in engine.generate("to-abort", [0, 7, 8],
                                         SamplingParams(max_tokens=500, ignore_eos=True,
                                                        output_kind="delta")):
            outs.append(out)
            if len(outs) == 3:
                engine.abort("to-abort")
        return outs

    outs = run(asyncio.wait_for(main(), timeout=10))
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert 3 <= len(outs) < 500
    assert engine.get_stats()["num_free_blocks"] == engine.get_stats()["num_total_blocks"]


def test_the_loop_thread_builds_and_steps_the_engine_with_the_configured_threads(ckpt,
                                                                                  monkeypatch):
    """Everything torch runs in parallel happens on one thread: the loop thread builds the model
    and steps it. (A constructor thread that loaded and packed weights keeps an OpenMP team of
    its own; with more OpenMP threads than cores, libgomp stops spinning at its barriers and a
    decode step pays a sleep and a wake-up per parallel region.) torch's thread count is per
    thread under OpenMP, so the configured count must be set in the loop thread too."""
    import threading

    import torch

    from engine.llm_engine import LLMEngine

    seen: dict[str, set[tuple[int, int]]] = {"init": set(), "step": set()}
    init, step = LLMEngine.__init__, LLMEngine.step

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["init"].add((threading.get_ident(), torch.get_num_threads()))

    def recording_step(self):
        seen["step"].add((threading.get_ident(), torch.get_num_threads()))
        return step(self)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    eng = AsyncEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
                      num_threads=1)
    try:
        run(collect(eng, "t", [0, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True)))
    finally:
        eng.shutdown()
    assert seen["init"] == seen["step"] == {(eng._thread.ident, 1)}
    assert eng._thread.ident != threading.get_ident()


def test_a_build_error_is_raised_by_the_constructor(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        AsyncEngine(model=str(tmp_path / "missing"), dtype="float32")
