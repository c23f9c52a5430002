"""What constrains a request's output, from the fields OpenAI and vLLM clients send:
``response_format`` (``json_object``, ``json_schema``: completions and chat), vLLM's
``structured_outputs`` extension (``json``, ``regex``, ``choice``, ``grammar``) and the tool
choice of a chat request (``serve_app.protocol.tools``); all become the engine's
``StructuredOutputsParams``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from engine import StructuredOutputsParams
from serve_app.protocol.errors import FieldError, StrictModel
from serve_app.protocol.tools import ToolPlan


class JSONSchemaFormat(StrictModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise FieldError("response_format.json_schema", "is required when type is "
                             "'json_schema'")
        return self


class StructuredOutputs(StrictModel):
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def constraint(so: StructuredOutputs | None, fmt: ResponseFormat | None,
               plan: ToolPlan | None) -> StructuredOutputsParams | None:
    """What holds a request's output: its tool choice ("required" or a named function),
    else ``structured_outputs``, else a JSON ``response_format``; ``FieldError`` naming the
    field when a schema is invalid or accepts nothing, or when two of them are given."""
    if plan is not None and plan.mode != "auto":
        for i, tool in enumerate(plan.tools):  # each tool's schema, named after its field
            if plan.mode == "required" or tool.function.name == plan.named:
                _checked(StructuredOutputsParams(json=plan.schema(tool)),
                         f"tools.{i}.function.parameters")
        return plan.constraint()
    if so is not None:
        if fmt is not None and fmt.type != "text":
            raise FieldError("structured_outputs", "and a JSON response_format exclude each "
                             "other")
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice,
                                       grammar=so.grammar, json_object=so.json_object)
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    return _checked(StructuredOutputsParams(json=schema if schema is not None else
                                            {"type": "object"}),
                    "response_format.json_schema.schema")


def _checked(params: StructuredOutputsParams, field: str) -> StructuredOutputsParams:
    """``params`` (a JSON schema) once validated; its errors named after the ``field`` the
    client sent it in."""
    try:
        params.validate()
    except ValueError as e:
        raise FieldError(field, str(e).replace("structured_outputs.json is ", "", 1)) from None
    return params
