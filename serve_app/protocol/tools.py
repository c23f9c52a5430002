"""Tool calling on chat completions: the request's ``tools``, ``tool_choice`` and
``parallel_tool_calls``, the grammar that holds the output to valid calls, and the calls parsed
back out of the text.

- ``tool_choice="none"``: the tools are not shown to the model; plain text comes back.
- ``"required"``: the output is held (structured output) to a JSON array of one or more
  ``{"name": ..., "parameters": {...}}`` objects, each naming a tool and matching its
  parameters' schema (one object at most when ``parallel_tool_calls`` is false).
- a named function: the output is held to that function's parameters schema: its arguments.
- ``"auto"`` (the default with tools): the model writes calls in its own format, parsed by the
  app's ``tool_call_parser``: ``hermes`` (``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, Hermes and Qwen2.5) or ``llama3_json`` (``{"name": ..., "parameters": ...}``
  objects, ``;``-separated, Llama 3.1). Without a parser, or with a chat template that does not
  render tools, such a request is a 400 saying so.

The answer carries ``message.tool_calls`` (ids, names, arguments as JSON text) and
``finish_reason: "tool_calls"``; a stream sends the calls, whole, in one delta once the choice
ends (text the model wrote besides them first), which OpenAI's client assembles as usual.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from engine import StructuredOutputsParams
from serve_app.protocol.errors import StrictModel

PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128



class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    """A call in an assistant message the client sends back (with its ``role: "tool"``
    result after it)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolPlan:
    """What a chat request asks of tools, once checked."""

    mode: Literal["auto", "required", "named"]
    tools: list[Tool]
    parallel: bool = True
    named: str | None = None
    parser: str | None = None

    def schema(self, tool: Tool) -> dict[str, Any]:
        return tool.function.parameters or {"type": "object"}

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of ``required`` and named choices (``auto`` is the model's own)."""
        if self.mode == "named":
            [tool] = [t for t in self.tools if t.function.name == self.named]
            return StructuredOutputsParams(json=self.schema(tool))
        if self.mode == "required":
            call = [{"type": "object", "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": self.schema(t)}, "required": ["name", "parameters"],
                "additionalProperties": False} for t in self.tools]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputsParams(json=array)
        return None

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a finished choice's text; text that does not hold calls
        in the expected form stays content."""
        if self.mode == "named":
            assert self.named is not None
            return None, [_call(self.named, text)] if _is_json(text) else []
        if self.mode == "required":
            items = _loads(text)
            if isinstance(items, list) and all(_is_call(i, "parameters") for i in items):
                return None, [_call(i["name"], i["parameters"]) for i in items]
            return text, []
        if self.parser == "hermes":
            return _parse_hermes(text)
        return _parse_llama3(text)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _is_json(text: str) -> bool:
    return _loads(text) is not None or text.strip() == "null"


def _is_call(item: Any, args_key: str) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get(args_key), dict))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls = []
    for body in _HERMES.findall(text):
        item = _loads(body)
        if not _is_call(item, "arguments"):
            return text, []
        calls.append(_call(item["name"], item["arguments"]))
    if not calls:
        return text, []
    content = _HERMES.sub("", text).strip()
    return content or None, calls


def _parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        item = _loads(part.strip())
        key = "parameters" if isinstance(item, dict) and "parameters" in item else "arguments"
        if not _is_call(item, key):
            return text, []
        calls.append(_call(item["name"], item[key]))
    return None, calls


def template_arguments(text: str) -> Any:
    """A call's arguments as chat templates print them: the object (``tojson``), or the text
    when it is not a JSON object."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_has_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders a ``tools`` list (it mentions it)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "tools" in template
