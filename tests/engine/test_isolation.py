"""One request never hurts another: a failure inside a shared step fails its own request only,
a bad call queues nothing, a checkpoint the engine cannot load right is refused, and random
extreme sampling values (hypothesis) either raise ``ValueError`` naming the field or run beside
a long request without changing its tokens."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine import LLM, LLMEngine, SamplingParams
from tests.checkpoints import make_checkpoint

LONG = [0, *range(300, 330)]
LONG_PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def engine(ckpt):
    return LLMEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
                     progress=False)


@pytest.fixture(scope="module")
def long_alone(engine):
    engine.add_request("alone", LONG, LONG_PARAMS)
    return run_until_idle(engine)["alone"]


def run_until_idle(engine: LLMEngine, max_steps: int = 2000) -> dict[str, list[int]]:
    """Step until idle; every request's tokens (its last cumulative output) by id."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
    raise AssertionError("the engine did not finish")


def test_a_request_that_breaks_the_step_fails_alone(engine, long_alone):
    free = engine.kv.num_free_blocks
    engine.add_request("long", LONG, LONG_PARAMS)
    engine.add_request("bad", [0, 7, 8, 9], SamplingParams(max_tokens=30, temperature=0.8))
    engine.add_request("other", [0, 11, 12], SamplingParams(max_tokens=5, temperature=0.0,
                                                           ignore_eos=True))
    # A value validation missed (as top_k >= 2**63 once was): here a seed torch cannot take,
    # which fails while the sampler seeds the row. Such a failure used to fail every request of
    # the step.
    engine.groups["bad"].params.seed = 2 ** 70
    tokens = {}
    errors = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        errors += engine.pop_errors()
    assert [rid for rid, _ in errors] == ["bad"]
    assert "Overflow" in repr(errors[0][1])
    assert tokens["long"] == long_alone
    assert len(tokens["other"]) == 5
    assert "bad" not in tokens
    assert engine.kv.num_free_blocks == free  # the failed request's blocks came back


def test_generate_checks_every_prompt_before_queueing_any(ckpt):
    llm = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=2 << 20, block_size=8)
    good = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    bad_stop = SamplingParams(max_tokens=3, stop_token_ids=[10 ** 6])
    for prompts, params, message in [
        ([[0, 1, 2], [0, 3]], [good, bad_stop], "stop_token_ids must be in"),
        ([[0, 1, 2], [0, 10 ** 6]], good, "prompt token ids must be integers"),
        ([[0, 1, 2], [0, 3]], [good, {"max_tokens": 3}], "must be a SamplingParams"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished()
    outs = llm.generate([[0, 5, 6]], good, use_tqdm=False)
    assert [o.request_id for o in outs] == [outs[0].request_id]
    assert len(outs[0].outputs[0].token_ids) == 3
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq' is not supported"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"},
     "quantization_config: config_groups: Field required"),
    ("awq", "quantization_config must be a mapping"),
])
def test_an_unsupported_quantized_checkpoint_is_refused(tmp_path, quant, message):
    path = make_checkpoint(tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLMEngine(model=str(path), dtype="float32", kv_cache_memory_bytes=1 << 20,
                  progress=False)


# ---- fuzz: every field with extreme values ---------------------------------------------------

EXTREMES = st.sampled_from([
    0, 1, -1, 2, 7, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1,
    0.0, 0.5, -0.5, 1.5, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e-300,
    True, False, None, "", "5", "é\u0000🙂", [], [0], [-1], [2 ** 63], ["a"], [""],
    ["x"] * 1000, list(range(5000)), {}, {"a": 1},
])
FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
          "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "detokenize",
          "skip_special_tokens", "output_kind"]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(values=st.dictionaries(st.sampled_from(FIELDS), EXTREMES, min_size=1, max_size=3))
@example(values={"max_tokens": 2 ** 31 - 1, "min_tokens": 2 ** 31 - 1})  # the clamp below
def test_fuzzed_sampling_params_never_reach_a_step_they_can_break(engine, long_alone, values):
    base = {"max_tokens": 4}
    try:
        params = SamplingParams(**{**base, **values})
        engine.check_request([0, 5, 6], params)
    except ValueError as e:
        assert str(e).split(" ", 1)[0] in values, (values, e)  # names one of the fields set
        return
    if params.max_tokens is None or params.max_tokens > 8:
        params.max_tokens = 8  # keep the run short; the values under test are the others
        params.min_tokens = min(params.min_tokens, 8)  # still valid: add_request checks again
    engine.add_request("long", LONG, LONG_PARAMS)
    engine.add_request("fuzz", [0, 5, 6], params)
    tokens = run_until_idle(engine)
    assert engine.pop_errors() == []
    assert tokens["long"] == long_alone
