"""What the engine hands the serving layer's metrics: per-request timings on the final output,
the computed-token counter and the AsyncEngine's per-step records."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncEngine, LLMEngine, SamplingParams
from tests.checkpoints import make_checkpoint

PROMPTS = [[0, 5, 6, 7], [0, *range(100, 140)]]  # 4 and 41 tokens: no shared full block
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


def _params(kind: str = "delta") -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                          output_kind=kind, detokenize=False)


def test_final_output_carries_timings_and_counts(ckpt):
    eng = LLMEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
                    progress=False)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _params())
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    finals = {o.request_id: o for o in outs if o.finished}
    assert all(o.metrics == {} for o in outs if not o.finished)
    for i, p in enumerate(PROMPTS):
        m = finals[f"r{i}"].metrics
        assert set(m) == {"arrival_time", "first_scheduled_time", "first_token_time",
                          "finished_time", "num_prompt_tokens", "num_generation_tokens",
                          "num_preemptions"}
        assert (m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"]
                <= m["finished_time"])
        assert (m["num_prompt_tokens"], m["num_generation_tokens"], m["num_preemptions"]) == \
            (len(p), MAX_TOKENS, 0)
    # every prompt token once, then each generated token but the last is fed back
    computed = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (MAX_TOKENS - 1)
    assert eng.num_batched_tokens_total == computed
    assert eng.get_stats()["num_batched_tokens_total"] == computed


def test_abort_before_scheduling_has_no_scheduled_or_token_time(ckpt):
    eng = LLMEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
                    progress=False)
    eng.add_request("gone", PROMPTS[0], _params("final"))
    out = eng.abort("gone")
    assert out is not None and out.outputs[0].finish_reason == "abort"
    assert set(out.metrics) == {"arrival_time", "finished_time", "num_prompt_tokens",
                                "num_generation_tokens", "num_preemptions"}
    assert out.metrics["num_generation_tokens"] == 0


def test_async_engine_keeps_one_record_per_step(ckpt):
    eng = AsyncEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    try:
        async def run(rid, prompt):
            return [o async for o in eng.generate(rid, prompt, _params())]

        async def main():
            return await asyncio.gather(*(run(f"a{i}", p) for i, p in enumerate(PROMPTS)))

        asyncio.run(main())
        records = eng.pop_step_records()
        assert sum(n for _, n in records) == eng.get_stats()["num_batched_tokens_total"]
        assert all(d > 0 and n > 0 for d, n in records)
        assert len(records) >= MAX_TOKENS
        assert eng.pop_step_records() == []
    finally:
        eng.shutdown()
