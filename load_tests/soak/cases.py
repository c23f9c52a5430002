"""Every kind of bad (or valid but unusual) request the soak sends, with the status it must get.

The order of ``bad_cases`` is part of a run's seed: ``Mix.random_bad`` picks from it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from .spec import Limits

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class BadCase:
    name: str
    body: bytes | None
    status: int
    path: str = "/v1/completions"
    method: str = "POST"
    auth: str = "good"  # good | none | wrong | basic
    chunked: bool = False


def bad_cases(limits: Limits) -> list[BadCase]:
    """Every kind of bad request the soak sends, with the status it must get."""
    return (_malformed(limits) + _out_of_range(limits) + _over_limits(limits)
            + _valid_unusual(limits) + _limit_and_auth(limits))


def _json(limits: Limits, **kw: Any) -> bytes:
    return json.dumps({"model": limits.model, **kw}).encode()


def _malformed(limits: Limits) -> list[BadCase]:
    """Not JSON, not an object, prompts and messages of the wrong type or empty."""
    j = functools.partial(_json, limits)
    chat = CHAT
    return [
        BadCase("malformed_json", b'{"prompt": "hi", ', 400),
        BadCase("not_an_object", b'[1, 2, 3]', 400),
        BadCase("empty_body", b"", 400),
        BadCase("max_tokens_string", j(prompt="hi", max_tokens="7"), 400),
        BadCase("prompt_number", j(prompt=5), 400),
        BadCase("prompt_empty_list", j(prompt=[]), 400),
        BadCase("prompt_nested_empty", j(prompt=[[]]), 400),
        BadCase("prompt_negative_id", j(prompt=[-1]), 400),
        BadCase("prompt_id_outside_vocab", j(prompt=[10 ** 9]), 400),
        BadCase("prompt_id_huge", j(prompt=[2 ** 70]), 400),
        BadCase("messages_string", j(messages="hi"), 400, chat),
        BadCase("messages_empty", j(messages=[]), 400, chat),
        BadCase("role_unknown", j(messages=[{"role": "wizard", "content": "x"}]), 400, chat),
        BadCase("content_image", j(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]), 400, chat),
    ]


def _out_of_range(limits: Limits) -> list[BadCase]:
    """Sampling and output parameters outside their ranges or contradicting each other."""
    j = functools.partial(_json, limits)
    chat, msgs = CHAT, MSGS
    return [
        BadCase("stream_string", j(prompt="hi", stream="yes"), 400),
        BadCase("temperature_high", j(prompt="hi", temperature=5), 400),
        BadCase("temperature_nan", b'{"prompt": "hi", "temperature": NaN}', 400),
        BadCase("top_p_zero", j(prompt="hi", top_p=0), 400),
        BadCase("top_k_below_off", j(prompt="hi", top_k=-2), 400),
        BadCase("n_zero", j(prompt="hi", n=0), 400),
        BadCase("n_over_max", j(prompt="hi", n=limits.max_n + 1), 400),
        BadCase("max_tokens_negative", j(prompt="hi", max_tokens=-1), 400),
        BadCase("max_tokens_huge", j(prompt="hi", max_tokens=2 ** 40), 400),
        BadCase("min_tokens_over_max", j(prompt="hi", max_tokens=2, min_tokens=5), 400),
        BadCase("logprobs_over_max", j(prompt="hi", logprobs=50), 400),
        BadCase("top_logprobs_no_logprobs", j(messages=msgs, top_logprobs=2), 400, chat),
        BadCase("penalty_out_of_range", j(prompt="hi", presence_penalty=9), 400),
        BadCase("seed_huge", j(prompt="hi", seed=2 ** 70), 400),
        BadCase("stop_token_id_huge", j(prompt="hi", stop_token_ids=[2 ** 70]), 400),
        BadCase("stop_empty_string", j(prompt="hi", stop=[""]), 400),
        BadCase("stop_too_many", j(prompt="hi", stop=[str(k) for k in range(17)]), 400),
        BadCase("logit_bias_out_of_range", j(prompt="hi", logit_bias={"5": 101}), 400),
        BadCase("logit_bias_not_a_token_id", j(prompt="hi", logit_bias={"five": 1}), 400),
        BadCase("logit_bias_over_vocab", j(prompt="hi", logit_bias={str(2 ** 31 - 1): 1}), 400),
        BadCase("stream_options_without_stream", j(prompt="hi", stream_options={
            "include_usage": True}), 400),
        BadCase("prompt_logprobs_streamed", j(prompt="hi", prompt_logprobs=1, stream=True), 400),
    ]


def _over_limits(limits: Limits) -> list[BadCase]:
    """Requests over the server's limits, routes and methods it does not serve, hostile JSON."""
    j = functools.partial(_json, limits)
    chat, mml = CHAT, limits.max_model_len
    return [
        BadCase("prompt_over_max_model_len", j(prompt=[5] * (mml + 8)), 400),
        BadCase("prompt_plus_max_tokens_over_len", j(prompt=[5] * (mml - 4), max_tokens=8), 400),
        BadCase("chat_over_max_model_len", j(messages=[
            {"role": "user", "content": "token " * (mml * 2)}]), 400, chat),
        BadCase("unknown_model", json.dumps({"model": "gpt-17", "prompt": "hi"}).encode(), 404),
        BadCase("body_over_limit", j(prompt="x" * (limits.max_body_bytes + 16)), 413),
        BadCase("body_over_limit_chunked", j(prompt="x" * (limits.max_body_bytes + 16)), 413,
                chunked=True),
        BadCase("unknown_route", j(prompt="hi"), 404, "/v1/engines/x/completions"),
        BadCase("wrong_method", None, 405, method="GET"),
        BadCase("deep_nesting", b'{"prompt": ' + b"[" * 20000 + b"]" * 20000 + b"}", 400),
        BadCase("lone_surrogate", b'{"prompt": "abc \\ud800 def"}', 400),
        BadCase("stop_token_id_outside_vocab", j(prompt="hi", max_tokens=4, min_tokens=2,
                                                 stop_token_ids=[10 ** 9]), 400),
        BadCase("too_many_prompts", j(prompt=["hi"] * (limits.max_waiting_requests + 1),
                                      max_tokens=1), 400),
    ]


def _valid_unusual(limits: Limits) -> list[BadCase]:
    """Valid but unusual input: answered normally (200), never a 5xx."""
    j = functools.partial(_json, limits)
    return [
        BadCase("top_k_over_vocab", j(prompt="hi", max_tokens=2, top_k=10 ** 9), 200),
        BadCase("top_k_zero_is_off", j(prompt="hi", max_tokens=2, top_k=0), 200),
        BadCase("echo_with_logprobs", j(prompt="hi", echo=True, logprobs=1, max_tokens=0), 200),
        BadCase("seed_negative", j(prompt="hi", max_tokens=2, temperature=1, seed=-5), 200),
        BadCase("seed_max", j(prompt="hi", max_tokens=2, temperature=1, seed=2 ** 63 - 1), 200),
        BadCase("unicode_prompt", j(prompt="h\u00e9llo \u4e16\u754c \U0001f600", max_tokens=2), 200),
        BadCase("extra_fields", j(prompt="hi", max_tokens=2, best_of=1, foo={"bar": 1}), 200),
        BadCase("stop_token_id_with_min_tokens", j(prompt="hi", max_tokens=4, min_tokens=2,
                                                   stop_token_ids=[3]), 200),
    ]


def _limit_and_auth(limits: Limits) -> list[BadCase]:
    """Over ``max_tokens_limit`` when the server has one; without or with a wrong API key when
    it needs one."""
    j = functools.partial(_json, limits)
    chat, msgs = CHAT, MSGS
    cases = []
    if limits.max_tokens_limit is not None:
        cases.append(BadCase("max_tokens_over_limit",
                             j(prompt="hi", max_tokens=limits.max_tokens_limit + 1), 400))
    if limits.api_key:
        ok = j(prompt="hi", max_tokens=2)
        cases += [BadCase("no_api_key", ok, 401, auth="none"),
                  BadCase("wrong_api_key", ok, 401, auth="wrong"),
                  BadCase("basic_auth", ok, 401, auth="basic"),
                  BadCase("models_no_key", None, 401, "/v1/models", "GET", auth="none"),
                  BadCase("stats_no_key", None, 401, "/v1/stats", "GET", auth="none"),
                  BadCase("chat_wrong_key", j(messages=msgs), 401, chat, auth="wrong"),
                  BadCase("openapi_no_key", None, 404, "/openapi.json", "GET", auth="none"),
                  BadCase("docs_no_key", None, 404, "/docs", "GET", auth="none")]
    return cases
