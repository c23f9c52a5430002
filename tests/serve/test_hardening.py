"""Bounds on one request, without a Ray cluster.

* ``n``, ``max_tokens``, the number of prompts, ``seed`` and ``stop_token_ids`` are bounded
  before a request reaches a Worker (400 naming the field), so one request can neither take
  every KV block nor break an engine step that other requests share.
* An empty API key is a start-up error; admission counts sequences, not prompts.

A dead Worker's batch is ``test_worker_client.py``'s.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.core.sampling_params import SamplingParams
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import CompletionRequest, parse_request
from serve_app.router.batch import EngineRequest
from serve_app.router.prompts import PromptProcessor


class _Tokenizer:
    def __len__(self) -> int:
        return 100

    def __call__(self, text: str, **_):
        return SimpleNamespace(input_ids=[5] * len(text.split()))


def _processor(**kw) -> PromptProcessor:
    info = {"tokenizer": _Tokenizer(), "max_model_len": 64, "vocab_size": 100}
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
    from serve_app.router.admission import Admission
    from serve_app.router.router import Router

    cls = Router.func_or_class
    waiting = [EngineRequest([1, 2], SamplingParams(n=3)), EngineRequest([1], SamplingParams())]
    started = EngineRequest([1], SamplingParams(n=4))
    started.note_output(1.0)
    rejected = []
    router = SimpleNamespace(
        _counters={"requests_total": 0, "rejected_429_total": 0}, _ttft_ewma_s=0.0,
        admission=Admission(6, None, 0.0, {*waiting, started}, routing_stats=list),
        metrics=SimpleNamespace(rejected=rejected.append))
    assert router.admission.num_waiting() == 4
    cls._admit(router, 2)  # 4 + 2 <= 6: admitted
    with pytest.raises(APIError) as err:
        cls._admit(router, 3)
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "1"
    assert rejected == ["queue_full"]
    assert router._counters == {"requests_total": 2, "rejected_429_total": 1}
