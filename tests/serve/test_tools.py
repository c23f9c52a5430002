"""Tool calling (serve_app/protocol/tools.py): requests checked, the grammar of ``required`` and named
choices held by the engine on the random test model (whose text is noise: only the grammar
can make it valid calls), the parsers of ``auto`` (hermes, llama3_json), messages that carry
calls and results reaching the chat template, and the response shapes (JSON and stream)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM
from engine.models.default_model import default_model_path
from engine.tokenizer import load_tokenizer
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import ChatCompletionRequest
from serve_app.protocol.tools import ToolPlan, template_has_tools
from serve_app.router.chat_format import ChatFormat
from serve_app.router.prompts import PromptProcessor
from serve_app.router.streams import Delta
from tests.checkpoints import make_checkpoint

pytest.importorskip("xgrammar")

# A chat template that shows tools and earlier calls the Hermes / Qwen2.5 way (written here).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": "
    "{{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def install_tool_template(path: Path) -> Path:
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = install_tool_template(make_checkpoint(tmp_path_factory.mktemp("llama"),
                                                 max_position_embeddings=2048))
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8)


def processor(llm: LLM, parser: str | None = None) -> PromptProcessor:
    info = {"tokenizer": llm.engine.tokenizer, "max_model_len": 2048,
            "vocab_size": llm.engine.vocab_size}
    return PromptProcessor(info, "m", 16, tool_call_parser=parser)


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def generate_calls(llm: LLM, req: ChatCompletionRequest) -> list[tuple[str, list[dict]]]:
    """The request through the Router's preparation and the engine; each choice's parsed
    (finish reason, calls) as the final response has them."""
    prep = processor(llm).prepare_chat(req)
    [ids], [params], plan = prep.prompts, prep.params, prep.output.tools
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    fmt = ChatFormat("id", "m", llm.engine.tokenizer, len(out.outputs), tools=plan)
    decode = llm.engine.tokenizer.decode  # the Router detokenizes (params say not to)
    fmt.collect([Delta(c.index, decode(c.token_ids, skip_special_tokens=True),
                       list(c.token_ids), c.finish_reason) for c in out.outputs])
    body = fmt.final(usage=None)  # type: ignore[arg-type]
    return [(c["finish_reason"], c["message"].get("tool_calls") or []) for c in body["choices"]]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls_of_the_given_tools(llm, parallel):
    req = chat(messages=USER, tools=[WEATHER, TIME], tool_choice="required", n=2,
               temperature=1.0, seed=7, max_tokens=200, parallel_tool_calls=parallel)
    for finish, calls in generate_calls(llm, req):
        assert finish == "tool_calls" and calls
        assert len(calls) == 1 or parallel
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_a_named_function_is_called_with_its_schema(llm):
    req = chat(messages=USER, tools=[WEATHER, TIME], max_tokens=200, temperature=0.0,
               tool_choice={"type": "function", "function": {"name": "get_time"}})
    [(finish, [call])] = generate_calls(llm, req)
    assert finish == "tool_calls" and call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_time"])


def test_tool_choice_none_and_no_tools_give_text(llm):
    p = processor(llm)
    plain = p.prepare_chat(chat(messages=USER))
    none = p.prepare_chat(chat(messages=USER, tools=[WEATHER], tool_choice="none"))
    assert none.output.tools is None and none.prompts == plain.prompts  # tools not shown either
    assert none.params[0].structured_outputs is None


def test_auto_needs_a_parser_and_a_template_with_tools(llm):
    req = chat(messages=USER, tools=[WEATHER])
    with pytest.raises(APIError, match="tool_call_parser") as err:
        processor(llm).prepare_chat(req)
    assert (err.value.status, err.value.param) == (400, "tools")
    prep = processor(llm, "hermes").prepare_chat(req)
    [ids], [params], plan = prep.prompts, prep.params, prep.output.tools
    assert plan is not None and plan.mode == "auto" and params.structured_outputs is None
    text = llm.engine.tokenizer.decode(ids)
    assert '"name": "get_weather"' in text  # the template showed the tool
    plain = load_tokenizer(str(default_model_path()))  # the default model's: no tools
    assert not template_has_tools(plain)
    info = {"tokenizer": plain, "max_model_len": 2048, "vocab_size": 768}
    with pytest.raises(APIError, match="does not render tools"):
        PromptProcessor(info, "m", 16, tool_call_parser="hermes").prepare_chat(req)


def test_earlier_calls_and_results_reach_the_template(llm):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    req = chat(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}],
               tools=[WEATHER], tool_choice="required")
    assert req.chat_messages()[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert req.chat_messages()[2]["tool_call_id"] == "call_1"
    [ids] = processor(llm).prepare_chat(req).prompts
    text = llm.engine.tokenizer.decode(ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "-3 C" in text


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None,
     [("f", {"a": 1})]),
    ('Let me check.<tool_call>{"name": "f", "arguments": {}}</tool_call>'
     '<tool_call>{"name": "g", "arguments": {"b": "x"}}</tool_call>', "Let me check.",
     [("f", {}), ("g", {"b": "x"})]),
    ("no calls here", "no calls here", []),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # not an object: left as text
     '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
])
def test_hermes_parser(text, content, calls):
    plan = ToolPlan("auto", [], parser="hermes")
    got_content, got = plan.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 2}}',
     None, [("f", {}), ("g", {"x": 2})]),
    ("Paris is nice.", "Paris is nice.", []),
    ('{"name": "f"}', '{"name": "f"}', []),
])
def test_llama3_json_parser(text, content, calls):
    plan = ToolPlan("auto", [], parser="llama3_json")
    got_content, got = plan.parse(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls


def test_stream_holds_text_and_sends_calls_whole_at_the_end():
    plan = ToolPlan("auto", [], parser="hermes")
    fmt = ChatFormat("id", "m", None, 2, tools=plan)
    assert fmt.stream_chunks([Delta(0, "Sure.<tool_", [1]), Delta(1, "plain ", [2])]) == []
    chunks = fmt.stream_chunks([
        Delta(0, 'call>{"name": "f", "arguments": {"a": 1}}</tool_call>', [3], "stop"),
        Delta(1, "text", [4], "stop")])
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"],
               c["choices"][0]["finish_reason"]) for c in chunks]
    assert deltas[0] == (0, {"content": "Sure."}, None)
    index, delta, finish = deltas[1]
    [call] = delta["tool_calls"]
    assert index == 0 and finish is None and call["index"] == 0
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert deltas[2] == (0, {}, "tool_calls")
    assert deltas[3:] == [(1, {"content": "plain text"}, None), (1, {}, "stop")]
