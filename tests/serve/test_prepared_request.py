"""The Router's typed request path: a real Router (no cluster; a scripted Worker) answers
completions and chat, and each prompt's ``SamplingParams`` is built and validated exactly once,
with the model's generation_config defaults already merged into the request's fields (before,
``engine.with_defaults`` rebuilt the built parameters, validating them a second time)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest
from transformers import AutoTokenizer

from engine import SamplingParams
from serve_app.config import AppConfig
from serve_app.router.prompts import PromptProcessor
from serve_app.wire import StreamAttach
from tests.checkpoints import make_checkpoint
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)
from tests.serve.worker_scripts import ScriptedHandle, step

DEFAULTS = {"temperature": 0.5, "top_k": 5, "max_tokens": 3}  # a generation_config.json's


class _Worker(ScriptedHandle):
    """Answers ``generate_batch`` with its scripts, keeping the parameters it was sent; every
    other call never answers."""

    def __init__(self, *scripts: list) -> None:
        super().__init__(*scripts)
        self.sent: list[SamplingParams] = []

    @property
    def generate_batch(self) -> SimpleNamespace:
        scripted = super().generate_batch

        def remote(requests, **kw):
            self.sent.extend(r.params for r in requests)
            return scripted.remote(requests, **kw)

        return SimpleNamespace(remote=remote)

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(remote=lambda *a, **k: asyncio.sleep(3600))


def _answer(num_prompts: int) -> list:
    """The Worker's whole answer: two tokens and the end for each prompt of the batch."""
    return [StreamAttach("w1", "s1", False),
            step([(i, 0, [7, 8], "length", None) for i in range(num_prompts)],
                 done=[(i, 3, 0) for i in range(num_prompts)])]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_checkpoint(tmp_path_factory.mktemp("llama")))


def _post(monkeypatch, tokenizer, path: str, body: dict, num_prompts: int,
          ) -> tuple[httpx.Response, list[SamplingParams], list[SamplingParams]]:
    """``body`` to a real Router; its response, the ``SamplingParams`` validated while it was
    answered (one entry per ``validate`` call) and those the Worker was sent."""
    from ray import serve

    from serve_app.router import router as router_module

    user_cls = next(c for c in router_module.Router.func_or_class.__mro__ if "_run" in c.__dict__)
    replica = SimpleNamespace(replica_id=SimpleNamespace(unique_id="router-1"))
    monkeypatch.setattr(serve, "get_replica_context", lambda: replica)
    validated: list[SamplingParams] = []
    validate = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate",
                        lambda self: (validated.append(self), validate(self))[1])
    worker = _Worker(_answer(num_prompts))

    async def main() -> httpx.Response:
        router = object.__new__(user_cls)
        user_cls.__init__(router, worker, AppConfig())
        replica.servable_object = router
        router.prompts = PromptProcessor({"tokenizer": tokenizer, "max_model_len": 64,
                                          "vocab_size": 768, "default_sampling": DEFAULTS},
                                         "m", 16)
        router.workers.replicas = lambda: ["w1"]
        router.admission._routing_stats = lambda: []
        transport = httpx.ASGITransport(app=router_module.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post(path, json=body, timeout=30)

    return asyncio.run(main()), validated, worker.sent


@pytest.mark.usefixtures("recorded")
@pytest.mark.parametrize("path, body, num_prompts", [
    ("/v1/completions", {"prompt": "a b c", "top_k": 9}, 1),
    ("/v1/completions", {"prompt": ["a b", "c d e"], "top_k": 9}, 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 9}, 1),
])
def test_each_prompts_params_are_built_and_validated_once_with_the_defaults_in(
        monkeypatch, tokenizer, path, body, num_prompts):
    response, validated, sent = _post(monkeypatch, tokenizer, path, body, num_prompts)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2 * num_prompts
    assert len(validated) == num_prompts  # once per prompt: not once more for the defaults
    assert [id(p) for p in validated] == [id(p) for p in sent]  # the ones the Worker got
    # the model's defaults where the request left a field unset; the request's where it set it
    assert [(p.temperature, p.top_k, p.max_tokens) for p in sent] == [(0.5, 9, 3)] * num_prompts


@pytest.mark.usefixtures("recorded")
def test_a_value_the_engine_refuses_is_one_400_naming_it(monkeypatch, tokenizer):
    """A range left to ``SamplingParams`` (not checked by the request model as well) is still
    a 400 in OpenAI's shape naming the field, found by its one validation."""
    response, validated, sent = _post(monkeypatch, tokenizer, "/v1/completions",
                                      {"prompt": "a b c", "top_p": 0}, 1)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "top_p must be in (0, 1], got 0.0",
                                         "type": "invalid_request_error", "param": "top_p",
                                         "code": None}}
    assert (len(validated), sent) == (1, [])
