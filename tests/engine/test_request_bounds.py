"""Sampling input that would break an engine step is refused when the request is added, so it
fails that request alone instead of every request sharing the step."""

from __future__ import annotations

import pytest

from engine import LLMEngine, SamplingParams
from tests.checkpoints import make_checkpoint


def test_stop_token_ids_outside_the_vocabulary_and_huge_seeds_are_refused(tmp_path):
    engine = LLMEngine(model=str(make_checkpoint(tmp_path / "llama")), dtype="float32",
                       kv_cache_memory_bytes=1 << 20, progress=False)
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 767\], got \[768\]"):
        engine.add_request("a", [0, 5, 6], SamplingParams(stop_token_ids=[3, 768], min_tokens=2))
    with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 9223372036854775807\]"):
        SamplingParams(seed=2 ** 64)
    engine.add_request("b", [0, 5, 6], SamplingParams(
        stop_token_ids=[767], min_tokens=2, ignore_eos=True, max_tokens=4, seed=2 ** 63 - 1, n=2))
    finished = []
    for _ in range(20):
        finished += [o for o in engine.step() if o.finished]
        if finished:
            break
    assert [o.request_id for o in finished] == ["b"]
    assert all(len(c.token_ids) == 4 for c in finished[0].outputs)
