"""OpenAI request bodies: completions and chat.

Validation is strict (``"5"`` is not a number) and parses the raw body once with
``model_validate_json``, so malformed JSON, wrong types and the ranges checked here all become
a 400 naming the field. The ranges checked here are those the Router reads before the engine's
parameters exist and OpenAI's own; the engine's ranges are ``SamplingParams``' to check, once,
when ``serve_app/protocol/sampling.py`` builds it. Unknown fields are ignored, as OpenAI-compatible servers do; known OpenAI
and vLLM features this server does not implement are rejected explicitly rather than silently
dropped (vLLM's extensions, done and refused: ``serve_app/protocol/vllm_fields.py``).
What constrains the output (``response_format``, ``structured_outputs``) is read in
``serve_app/protocol/constraints.py``, tools in ``serve_app/protocol/tools.py``. Responses are plain dicts built
in ``serve_app/router/responses.py`` and beside it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, model_validator

from engine import INT32_MAX, MAX_BIAS, MAX_N, MAX_STOP_LEN
from serve_app.protocol.chat_template import ChatMessage, check_chat_options
from serve_app.protocol.constraints import ResponseFormat, StructuredOutputs
from serve_app.protocol.errors import FieldError, StrictModel, from_validation_error
from serve_app.protocol.tools import (
    MAX_TOOLS,
    NamedToolChoice,
    Tool,
    ToolChoice,
    ToolPlan,
)
from serve_app.protocol.vllm_fields import MAX_ALLOWED_IDS, VLLMExtensions

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1  # seed: refused here, as JSON parses it

TokenIds = list[Annotated[int, Field(ge=0, le=INT32_MAX)]]
# logit_bias: OpenAI's keys are token ids written as strings, its values lie in [-100, 100]
BiasValue = Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS, allow_inf_nan=False)]


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, "
                                         "every chunk carries the usage so far.")


class SamplingRequest(VLLMExtensions):
    """Fields shared by completions and chat (vLLM's extensions:
    ``serve_app.protocol.vllm_fields``). Ranges the engine checks (``top_p``, ``top_k``,
    ``min_p``, penalties, ``min_tokens``, ...) are left to ``SamplingParams``."""

    model: str | None = Field(None, description="Served model name; the only model if omitted.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = 1.0
    top_k: int = Field(-1, description="0 or -1 turns it off.")
    min_p: float = 0.0
    n: int = Field(1, ge=1, le=MAX_N, description="Choices per prompt; the Router bounds it "
                   "(max_n).")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    logit_bias: dict[str, BiasValue] | None = Field(
        None, max_length=MAX_ALLOWED_IDS, description="Token id (a string, e.g. \"1234\") -> "
        "a number in [-100, 100] added to its logit before sampling.")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's extension: exactly one of json, regex, choice, grammar.")

    @model_validator(mode="after")
    def _check_fields(self) -> SamplingRequest:
        if any(not (k.isascii() and k.isdigit() and int(k) <= INT32_MAX)
               for k in self.logit_bias or ()):
            raise FieldError("logit_bias", f"keys must be token ids, integers in [0, {INT32_MAX}] "
                             "written as strings")
        if len(self.stop_list()) > 16:
            raise FieldError("stop", "accepts at most 16 strings")
        if not all(self.stop_list()):
            raise FieldError("stop", "strings must not be empty")
        if max(map(len, self.stop_list()), default=0) > MAX_STOP_LEN:
            raise FieldError("stop", f"strings may have at most {MAX_STOP_LEN} characters (the "
                             "Router holds that much text back and searches it every token)")
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "is only allowed when stream is true")
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "is not supported when streaming")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage and bool(self.stream_options and
                                           self.stream_options.continuous_usage_stats)

    def logit_bias_ids(self) -> dict[int, float] | None:
        return None if self.logit_bias is None else {
            int(k): v for k, v in self.logit_bias.items()}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | TokenIds | list[TokenIds] = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    max_tokens: int | None = Field(16, ge=0, le=INT32_MAX, description="0: the prompt only "
                                   "(with echo and logprobs: its logprobs).")
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.suffix:
            raise FieldError("suffix", "is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise FieldError("prompt", "must not be empty")
        if self.echo and self.logprobs is not None and self.stream:
            raise FieldError("echo", "together with logprobs is not supported when streaming")
        return self

    def num_prompt_logprobs(self) -> int | None:
        """Top-N of prompt tokens the engine computes: for ``prompt_logprobs``, and for the
        echoed prompt's ``logprobs``."""
        echoed = self.logprobs if self.echo else None
        asked = [x for x in (self.prompt_logprobs, echoed) if x is not None]
        return max(asked) if asked else None

    max_tokens_param: ClassVar[str] = "max_tokens"  # the field bounding the output (errors)

    def prompts(self) -> list[str | list[int]]:
        """One entry per engine request: a string or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:  # refused by _check_prompt; here so that p[0] narrows p's type
            return []
        if isinstance(p[0], int):
            return [p]
        return list(p)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX, description="Deprecated alias "
                                   "of max_completion_tokens.")
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="End the prompt inside the last "
                                         "(assistant) message, for the model to continue it.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Variables for the "
                                                        "chat template, e.g. enable_thinking.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        self._check_tools()
        check_chat_options(self.add_generation_prompt, self.continue_final_message,
                           self.messages[-1].role, self.chat_template_kwargs)
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs=true")
        return self

    @property
    def max_tokens_param(self) -> str:
        """The field that bounds the output, for error messages."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise FieldError("tools", "function names must be unique")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            raise FieldError("tool_choice", "needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"names {choice.function.name!r}, which is not "
                             f"one of the tools")
        constrained = self.structured_outputs is not None or (
            self.response_format is not None and self.response_format.type != "text")
        if constrained and (choice == "required" or isinstance(choice, NamedToolChoice)):
            raise FieldError("tool_choice", "'required' or a named function excludes "
                             "response_format and structured_outputs")

    def tool_plan(self, parser: str | None = None) -> ToolPlan | None:
        """The checked tool request (None: no tools, or ``tool_choice="none"``)."""
        choice = self.tool_choice if self.tool_choice is not None else "auto"
        if not self.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return ToolPlan("named", self.tools, self.parallel_tool_calls, choice.function.name)
        mode: Literal["auto", "required"] = "required" if choice == "required" else "auto"
        return ToolPlan(mode, self.tools, self.parallel_tool_calls, parser=parser)


R = TypeVar("R", bound=SamplingRequest)


def parse_request(cls: type[R], body: bytes) -> R:
    """Validate a raw JSON body; any problem is a 400 naming the field."""
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
