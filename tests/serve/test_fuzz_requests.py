"""Fuzz of both endpoints' bodies, without a Ray cluster: the Router's checks in the Router's
order (parse, model, size, tokenize and fit), then the engine with a long request beside.

Every field of completions and chat gets random extreme values (0, -1, 2**31, 2**63, 2**64,
1e308, NaN, infinities, wrong types, empty and huge lists, unicode). Each body is either
refused with 400 (404 for ``model``) naming one of the fields it set, or accepted; an accepted
one then runs in an engine step shared with a long request, which must finish with exactly the
tokens it has alone. ``tests/serve/test_app.py`` sends the same kind of bodies over HTTP.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLMEngine, SamplingParams
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest, parse_request
from serve_app.router.prompts import PromptProcessor
from tests.checkpoints import make_checkpoint
from tests.engine.test_isolation import run_until_idle

MAX_MODEL_LEN = 128
LONG = [0, *range(300, 330)]
LONG_PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, detokenize=False)

EXTREMES = [
    0, 1, -1, 2, 2 ** 31 - 1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -(2 ** 63) - 1,
    0.0, 0.5, -0.5, 1.5, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e-300,
    True, False, None, "", "5", "é\u0000🙂\ud7ff", "x" * 5000, [], [0], [-1], [2 ** 63],
    [[0, 5], [7]], [[]], ["a"], [""], ["x"] * 100, list(range(3000)), {}, {"a": 1},
    {"5": 100}, {"5": -100.5}, {"767": 1e-300, "0": -7},
    {"type": "json_object"}, {"include_usage": True}, {"include_usage": "yes"},
    # structured output and tools: valid and broken specifications
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer"}}},
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {"type": 5}}},
    {"json": {"type": "object"}}, {"regex": "[a-z]{1,3}"}, {"regex": "("}, {"choice": ["a", "b"]},
    {"choice": []}, {"grammar": 'root ::= "x"'}, {"json": "{"}, {"regex": "a", "choice": ["a"]},
    [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    [{"type": "function", "function": {"name": "bad name!"}}], "required", "auto", "none",
    {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}},
]
COMMON = ["model", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
          "stop_token_ids", "stream", "stream_options", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
          "skip_special_tokens", "include_stop_str_in_output", "user", "logit_bias",
          "max_tokens", "response_format", "structured_outputs",
          # vLLM's: implemented, then refused unless their value changes nothing
          "prompt_logprobs", "truncate_prompt_tokens", "allowed_token_ids", "bad_words",
          "cache_salt", "return_token_ids", "return_tokens_as_token_ids", "best_of", "use_beam_search", "guided_json",
          "length_penalty"]
FIELDS = {
    "completions": COMMON + ["prompt", "logprobs", "echo", "suffix"],
    "chat": COMMON + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                      "add_generation_prompt", "tools", "tool_choice", "parallel_tool_calls"],
}
BASE = {"completions": {"prompt": "Hello there", "max_tokens": 4},
        "chat": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}}
MESSAGES = [[], [{"role": "user"}], [{"role": "user", "content": 5}],
            [{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "text",
                                                                                  "text": "é"}]}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            [{"role": "assistant", "content": None}], "hi", [{"role": "user", "content": "🙂" * 300}]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("llama"))
    return LLMEngine(model=str(path), dtype="float32", kv_cache_memory_bytes=4 << 20,
                     block_size=8, max_model_len=MAX_MODEL_LEN, progress=False)


@pytest.fixture(scope="module")
def processor(engine):
    info = {"tokenizer": engine.tokenizer, "max_model_len": MAX_MODEL_LEN,
            "vocab_size": engine.vocab_size}
    return PromptProcessor(info, "served-name", 16, max_n=4, max_prompts=64)


@pytest.fixture(scope="module")
def long_alone(engine):
    engine.add_request("alone", LONG, LONG_PARAMS)
    return run_until_idle(engine)["alone"]


def _handle(p: PromptProcessor, endpoint: str, body: bytes):
    """The Router's checks, in its order; the prompts' token ids and params, or APIError."""
    if endpoint == "completions":
        req = parse_request(CompletionRequest, body)
        p.check_model(req.model)
        p.check_size(len(req.prompts()), req.n, req.max_tokens, req.max_tokens_param)
        prep = p.prepare_completion(req)
        prompts, params = prep.prompts, prep.params
        return prompts, params
    req = parse_request(ChatCompletionRequest, body)
    p.check_model(req.model)
    p.check_size(1, req.n, req.completion_limit(), req.max_tokens_param)
    prep = p.prepare_chat(req)
    [ids], params = prep.prompts, prep.params
    return [ids], params


def bodies(endpoint: str):
    values = st.sampled_from(EXTREMES)
    by_field = {f: (st.one_of(values, st.sampled_from(MESSAGES)) if f == "messages" else values)
                for f in FIELDS[endpoint]}
    return st.fixed_dictionaries({}, optional=by_field).filter(bool)


@settings(max_examples=250, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data(), endpoint=st.sampled_from(["completions", "chat"]))
def test_fuzzed_bodies_are_refused_by_field_or_run_beside_a_long_request(
        engine, processor, long_alone, data, endpoint):
    fields = data.draw(bodies(endpoint))
    body = json.dumps({**BASE[endpoint], **fields}).encode()  # NaN and Infinity as JS writes them
    try:
        prompts, params = _handle(processor, endpoint, body)
    except APIError as e:
        assert e.status in (400, 404), (fields, e.status, e.message)
        assert e.param is not None, (fields, e.message)
        assert e.param.split(".")[0] in {*fields, "max_tokens"}, (fields, e.param, e.message)
        return
    for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
        if sp.max_tokens > 6:
            sp.max_tokens = 6  # keep the run short; the other values are what is under test
        sp.min_tokens = min(sp.min_tokens, sp.max_tokens)
        engine.add_request(f"fuzz-{i}", ids, sp)
    engine.add_request("long", LONG, LONG_PARAMS)
    tokens = run_until_idle(engine)
    assert engine.pop_errors() == []
    assert tokens["long"] == long_alone
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_field_errors_across_fields_name_the_field(processor):
    for endpoint, extra, param in [
        ("completions", {"stop": [""]}, "stop"),
        ("completions", {"prompt": []}, "prompt"),
        ("completions", {"suffix": "x"}, "suffix"),
        ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"tools": [{"type": "function"}]}, "tools.0.function"),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ("completions", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ("completions", {"response_format": {"type": "json_schema", "json_schema": {
            "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
        ("chat", {"max_completion_tokens": 2 ** 31 - 1}, "max_completion_tokens"),
        ("completions", {"top_k": 2 ** 63}, "top_k"),
        ("completions", {"temperature": math.nan}, "temperature"),
        ("completions", {"stop": ["x" * 1025]}, "stop"),
        ("completions", {"use_beam_search": True}, "use_beam_search"),
        ("completions", {"best_of": 2}, "best_of"),
        ("chat", {"guided_json": {"type": "object"}}, "guided_json"),
        ("chat", {"echo": True}, "echo"),
        ("completions", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ("completions", {"allowed_token_ids": [5, 768]}, "allowed_token_ids"),
        ("completions", {"logit_bias": {"5": 1, "768": 1}}, "logit_bias"),
        ("chat", {"logit_bias": {"5": -100.01}}, "logit_bias.5"),
        ("chat", {"logit_bias": {"5x": 1}}, "logit_bias"),
        ("chat", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("chat", {"cache_salt": ""}, "cache_salt"),
        ("completions", {"bad_words": [" "]}, "bad_words"),
        ("chat", {"add_special_tokens": True}, "add_special_tokens"),
        ("completions", {"length_penalty": 0.5}, "length_penalty"),
    ]:
        with pytest.raises(APIError) as err:
            _handle(processor, endpoint, json.dumps({**BASE[endpoint], **extra}).encode())
        assert (err.value.status, err.value.param) == (400, param), err.value.message


def test_vllm_fields_reach_the_engine_params(processor):
    body = {"prompt": "word " * 400, "truncate_prompt_tokens": 10, "best_of": 1, "top_k": 0,
            "use_beam_search": False, "allowed_token_ids": [5, 6], "bad_words": ["x"],
            "cache_salt": "tenant-1", "logit_bias": {"5": -2.5, "0007": 100}, "echo": True, "logprobs": 2, "prompt_logprobs": 1,
            "max_tokens": 0, "unknown_field": 1, "add_special_tokens": True, "guided_json": None}
    prompts, params = _handle(processor, "completions", json.dumps(body).encode())
    tok = processor.tokenizer
    assert prompts == [tok("word " * 400).input_ids[-10:]]
    sp = params[0]
    assert (sp.top_k, sp.max_tokens, sp.prompt_logprobs, sp.logprobs) == (0, 0, 2, 2)
    assert (sp.truncate_prompt_tokens, sp.allowed_token_ids, sp.bad_words, sp.cache_salt) == (
        10, [5, 6], ["x"], "tenant-1")
    assert sp.logit_bias == {5: -2.5, 7: 100.0}
    chat = {"messages": [{"role": "user", "content": "Hi " * 300}], "truncate_prompt_tokens": 5}
    assert [len(ids) for ids in _handle(processor, "chat", json.dumps(chat).encode())[0]] == [5]


def test_fast_encoding_equals_the_tokenizer_and_refuses_long_prompts_by_count(processor):
    tok = processor.tokenizer
    texts = ["Hello, my name is", "  leading spaces", "é🙂\u0000 mixed", "<|endoftext|>x",
             "a" * 60, ""]
    for text in texts:
        assert processor.encode(text, add_special_tokens=True) == tok(text).input_ids
        assert processor.encode(text, add_special_tokens=False) == \
            tok(text, add_special_tokens=False).input_ids
    with pytest.raises(APIError) as err:
        processor.encode("word " * 400)
    assert err.value.code == "context_length_exceeded"
    assert f"{len(tok('word ' * 400).input_ids)} tokens" in err.value.message
