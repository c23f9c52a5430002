"""Structured-output specifications that cannot be served are 400s naming their field, never
500s: without Ray, the Router's checks (``_handle``: parse, model, size, prepare) refuse a
grammar, regex or schema that accepts nothing, in every field that carries one; and a Worker
answers a grammar that overran ``grammar_compile_timeout_s`` with a 400 naming the field and
the bound, which the Router's stream turns into OpenAI's error body."""

from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from engine.async_engine import AsyncEngine
from engine.core.sampling_params import SamplingParams
from engine.grammar.structured_output import StructuredOutputsParams
from serve_app.config import AppConfig
from serve_app.protocol.errors import APIError
from serve_app.router.batch import Batch, EngineRequest
from serve_app.router.prompts import PromptProcessor
from serve_app.router.streams import ResponseStream
from serve_app.router.worker_client import fan_out
from serve_app.worker.worker import Worker
from tests.checkpoints import make_checkpoint
from tests.engine.test_grammar_deadline import SLOW_GRAMMAR
from tests.serve.test_fuzz_requests import BASE, _handle
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)

pytest.importorskip("xgrammar")

NOTHING = {"type": "object", "properties": {"a": {"type": "string", "pattern": "[^\\s\\S]"}},
           "required": ["a"]}  # xgrammar's grammar for it accepts nothing
CLASH = {"allOf": [{"type": "string"}, {"type": "integer"}]}  # xgrammar drops part of it
TOOL = {"type": "function", "function": {"name": "f", "parameters": CLASH}}
CASES = [  # (endpoint, fields, the 400's param, its message)
    ("completions", {"structured_outputs": {"grammar": "root ::= root"}},
     "structured_outputs.grammar", "structured_outputs.grammar is unsatisfiable: it accepts no "
     "string (its root rule never completes)"),
    ("chat", {"structured_outputs": {"grammar": 'root ::= "a" root'}},
     "structured_outputs.grammar", "structured_outputs.grammar is unsatisfiable: it accepts no "
     "string (its root rule never completes)"),
    ("completions", {"structured_outputs": {"regex": "ab[^\\s\\S]"}}, "structured_outputs.regex",
     "structured_outputs.regex is unsatisfiable: the regex matches no string"),
    ("completions", {"structured_outputs": {"json": NOTHING}}, "structured_outputs.json",
     "structured_outputs.json is unsatisfiable: no JSON value satisfies the schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": CLASH}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema: unsatisfiable: "
     "/allOf: the types (string; integer) have no value in common"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": NOTHING}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema: unsatisfiable: no JSON value satisfies the schema"),
    ("chat", {"tools": [TOOL], "tool_choice": "required"}, "tools.0.function.parameters",
     "tools.0.function.parameters: unsatisfiable: /allOf: the types (string; integer) have no "
     "value in common"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "g"}}, TOOL],
              "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.1.function.parameters", "tools.1.function.parameters: unsatisfiable: /allOf: the "
     "types (string; integer) have no value in common"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def processor(ckpt):
    info = {"tokenizer": AutoTokenizer.from_pretrained(ckpt), "max_model_len": 128,
            "vocab_size": 768}
    return PromptProcessor(info, "served-name", 16, max_n=4, max_prompts=64)


@pytest.mark.parametrize("endpoint, fields, param, message", CASES,
                         ids=[c[2] + f"-{i}" for i, c in enumerate(CASES)])
def test_specifications_that_accept_nothing_are_400s_naming_the_field(
        processor, endpoint, fields, param, message):
    body = json.dumps({**BASE[endpoint], **fields}).encode()
    with pytest.raises(APIError) as err:
        _handle(processor, endpoint, body)
    assert (err.value.status, err.value.param, err.value.message) == (400, param, message)
    assert err.value.body() == {"error": {"message": message, "type": "invalid_request_error",
                                          "param": param, "code": None}}


def test_a_grammar_past_the_compile_bound_is_a_400_from_the_worker(ckpt, recorded):  # noqa: F811
    config = AppConfig(model=str(ckpt), dtype="float32", max_model_len=128, block_size=8,
                       kv_cache_memory_bytes=4 << 20, num_threads=1, accelerator="cpu",
                       grammar_compile_timeout_s=0.3)
    params = SamplingParams(max_tokens=4, temperature=0.0, detokenize=False, output_kind="delta",
                            structured_outputs=StructuredOutputsParams(grammar=SLOW_GRAMMAR))

    async def main() -> APIError:
        worker = Worker(config, engine_factory=lambda cfg: AsyncEngine(cfg.engine),
                        replica_id="w1")
        try:
            routed = EngineRequest([0, 5, 9], params)
            await asyncio.wait_for(fan_out(Batch([routed]), worker.generate_batch(
                [routed.wire()])), 60)
            with pytest.raises(APIError) as err:  # the Worker's ErrorPart, as the Router reads it
                await anext(ResponseStream([routed], worker.engine.tokenizer, [], False, True,
                                           None, lambda r, reason: None).deltas())
            return err.value
        finally:
            worker.engine.shutdown()

    error = asyncio.run(main())
    message = ("structured_outputs.grammar took longer than 0.3 s to compile "
               "(grammar_compile_timeout_s); simplify it")
    assert (error.status, error.message) == (400, message)
    assert error.body()["error"]["type"] == "invalid_request_error"
