"""Structured output on the engine (engine/grammar/structured_output.py, xgrammar): the random test
model's text is noise, so the grammar alone makes each output valid. Every JSON-schema output
parses and validates (``jsonschema``); regex and choice outputs match; ``n=2``, streaming
(``AsyncEngine``), sampling, a batch mixing constrained and free rows, ``max_tokens`` reached
first ("length"), preemption, and bad specifications (``ValueError`` naming them)."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.async_engine import AsyncEngine
from engine.grammar.structured_output import choice_ebnf
from tests.checkpoints import make_checkpoint

pytest.importorskip("xgrammar")

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object",  # nesting, enums, arrays, bounded numbers, required fields
     "properties": {
         "name": {"type": "string", "maxLength": 8},
         "color": {"enum": ["red", "green", "blue"]},
         "age": {"type": "integer", "minimum": 0, "maximum": 120},
         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                  "maxItems": 3},
         "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5,
                                                          "maximum": 5},
                                                    "y": {"type": "boolean"}},
                   "required": ["x", "y"], "additionalProperties": False}},
     "required": ["name", "color", "age", "tags", "point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99},
     "minItems": 2, "maxItems": 4},
]
PROMPTS = [[5, 9, 33, 41], [100, 7, 250, 3, 19, 8]]


def run(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8, seed=0)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "array"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, schema, temperature):
    params = SamplingParams(n=2, max_tokens=200, temperature=temperature, seed=3,
                            structured_outputs=StructuredOutputsParams(json=schema))
    for out in run(llm, params):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_and_choice(llm):
    [obj] = run(llm, SamplingParams(max_tokens=300, temperature=0.0, structured_outputs=
                                    StructuredOutputsParams(json_object=True)), PROMPTS[:1])
    if obj.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    else:  # free-form JSON may not close within the limit: what came is a JSON object's start
        assert obj.outputs[0].text.startswith("{")
    pattern = r"[a-c]{2,4}-\d{3}"
    for out in run(llm, SamplingParams(n=2, max_tokens=30, temperature=1.0, seed=1,
                                       structured_outputs=StructuredOutputsParams(regex=pattern))):
        for c in out.outputs:
            assert re.fullmatch(pattern, c.text) and c.finish_reason == "stop"
    choices = ["yes", "no", 'say "maybe"\n']
    seen = set()
    for seed in range(6):
        for out in run(llm, SamplingParams(max_tokens=20, temperature=1.0, seed=seed,
                                           structured_outputs=StructuredOutputsParams(
                                               choice=choices))):
            assert out.outputs[0].text in choices
            seen.add(out.outputs[0].text)
    assert len(seen) >= 2  # sampling picks among them
    [ebnf] = run(llm, SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=
                                     StructuredOutputsParams(grammar='root ::= "x" [0-9] "y"')),
                 PROMPTS[:1])
    assert re.fullmatch(r"x\dy", ebnf.outputs[0].text)


def test_constrained_and_free_rows_share_a_batch(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = run(llm, free)
    schema = SCHEMAS[0]
    mixed = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1]}],
        [free, SamplingParams(max_tokens=50, temperature=0.0,
                              structured_outputs=StructuredOutputsParams(json=schema))],
        use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids  # untouched
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), schema)


def test_max_tokens_before_the_grammar_ends_is_length(llm):
    [out] = run(llm, SamplingParams(max_tokens=3, temperature=0.0, structured_outputs=
                                    StructuredOutputsParams(json=SCHEMAS[1])), PROMPTS[:1])
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    assert out.outputs[0].text.startswith('{"')


def test_preempted_requests_keep_their_grammar(ckpt, llm):
    """A cache of 8 blocks of 8 tokens (4 KiB each) for 4 sequences growing to ~45 tokens:
    requests are preempted and recomputed, and their matchers carry on where they were: the
    same outputs as with room for all."""
    small = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=8 * 4096, block_size=8, seed=0,
                max_model_len=64)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99},
              "minItems": 8, "maxItems": 8}
    params = SamplingParams(max_tokens=50, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    prompts = [p + [i] for i in range(2) for p in PROMPTS]
    outs = run(small, params, prompts)
    assert small.engine.scheduler.num_preemptions > 0
    roomy = run(llm, params, prompts)
    for out, want in zip(outs, roomy):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
        assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_streaming_deltas_assemble_a_valid_document(ckpt):
    schema = SCHEMAS[1]

    async def main() -> list[str]:
        engine = AsyncEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=8 << 20,
                             block_size=8)
        try:
            params = SamplingParams(n=2, max_tokens=200, temperature=0.7, seed=5,
                                    output_kind="delta",
                                    structured_outputs=StructuredOutputsParams(json=schema))
            texts = ["", ""]
            async for out in engine.generate("s", {"prompt_token_ids": PROMPTS[0]}, params):
                for c in out.outputs:
                    texts[c.index] += c.text
            return texts
        finally:
            engine.shutdown()

    for text in asyncio.run(main()):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "structured_outputs.json is invalid"),
    (dict(json="{not json"), "structured_outputs.json is invalid"),
    (dict(regex="(unclosed"), "structured_outputs.regex is invalid"),
    (dict(grammar="root ::= missing_rule"), "structured_outputs.grammar is invalid"),
    (dict(choice=[]), "structured_outputs.choice must be a list"),
    (dict(choice=["a", ""]), "structured_outputs.choice must be a list"),
    (dict(), "needs exactly one of json, regex, choice, grammar, json_object, got none"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(json=5), "structured_outputs.json must be a schema object"),
])
def test_bad_specifications_are_value_errors(llm, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run(llm, SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match="structured_outputs: .*unexpected keyword"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_choice_grammar_escapes_every_character():
    assert choice_ebnf(['a"b', "c\\d", "e\nf"]) == \
        'root ::= "a\\u0022b" | "c\\u005cd" | "e\\u000af"'
