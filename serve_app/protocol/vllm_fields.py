"""vLLM's request fields that this server does not implement: each is refused with a 400 naming
it, never silently dropped, unless its value is the one that changes nothing (``best_of`` equal
to ``n``, ``use_beam_search: false``, a ``None``).

Fields no OpenAI-compatible server knows stay ignored (``StrictModel``), as OpenAI's own API
does; the fields listed here are the ones a client sends expecting vLLM's behaviour. A field a
request model defines is implemented and never refused here, whatever this table says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field, model_validator

from engine import INT32_MAX, MAX_LOGPROBS
from serve_app.protocol.errors import FieldError, StrictModel

MAX_ALLOWED_IDS = 1 << 20  # allowed_token_ids (each must also be below the vocabulary size)


def _is(*values: object) -> Callable[[Any, dict[str, Any]], bool]:
    """A value that changes nothing is one of ``values`` (``None`` always is)."""
    return lambda v, _: v is None or any(v is x or (type(v) is type(x) and v == x)
                                         for x in values)


def _best_of(value: Any, body: dict[str, Any]) -> bool:
    return value is None or (type(value) is int and value == body.get("n", 1))


# field -> does this value leave the request as it would be without the field?
NO_OP: dict[str, Callable[[Any, dict[str, Any]], bool]] = {
    "best_of": _best_of,
    "use_beam_search": _is(False),
    "length_penalty": _is(1.0, 1),
    "spaces_between_special_tokens": _is(True),
    "include_reasoning": _is(True),
    "echo": _is(False),  # chat's (completions implement theirs)
    "priority": _is(0),
    # vLLM's defaults: true for completions, false for chat
    "add_special_tokens": lambda v, body: v is None or v is ("messages" not in body),
    **{name: _is() for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "logits_processors",
        "kv_transfer_params", "vllm_xargs", "prompt_embeds", "mm_processor_kwargs",
        "documents", "reasoning_effort", "request_id",
        "functions", "function_call", "audio", "modalities", "prediction", "thinking",
        "chat_template", "chat_template_kwargs", "continue_final_message", "top_logprobs",
        "truncate_prompt_tokens", "allowed_token_ids", "bad_words", "cache_salt",
        "prompt_logprobs")},
}

_HINTS = {"guided_json": "structured_outputs.json or response_format",
          "guided_regex": "structured_outputs.regex", "guided_choice": "structured_outputs.choice",
          "guided_grammar": "structured_outputs.grammar", "best_of": "n",
          "functions": "tools", "function_call": "tool_choice"}


def refuse_unimplemented(body: Any, defined: set[str]) -> None:
    """Raise ``FieldError`` for the first field of ``body`` (the raw JSON object) that vLLM
    implements, the request model does not (``defined``), and whose value would matter."""
    if not isinstance(body, dict):
        return
    for name, value in body.items():
        check = NO_OP.get(name)
        if check is None or name in defined or check(value, body):
            continue
        hint = _HINTS.get(name)
        raise FieldError(name, "is not supported by this server" + (
            f" (use {hint})" if hint else ""))


class VLLMExtensions(StrictModel):
    """vLLM's request fields beyond OpenAI's that this server implements (both endpoints;
    ``engine.core.sampling_params`` says what each does, and checks their ranges), and the
    refusal of those it does not."""

    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top-N "
                                        "logprobs of every prompt token (not when streaming).")
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=INT32_MAX,
                                               description="Keep the prompt's last N tokens.")
    allowed_token_ids: list[int] | None = Field(
        None, max_length=MAX_ALLOWED_IDS, description="Only these may be sampled.")
    bad_words: list[str] | None = Field(None, description="Words never generated (as vLLM "
                                        "tokenizes them).")
    cache_salt: str | None = Field(None, description="Prefix-cache blocks are shared only "
                                   "with the same salt.")
    return_token_ids: bool = Field(False, description="Choices carry their token ids, and the "
                                   "response the prompt's (streams: on the first chunk).")
    return_tokens_as_token_ids: bool = Field(False, description="Logprobs name tokens as "
                                             "'token_id:<id>' instead of their text.")

    @model_validator(mode="before")
    @classmethod
    def _unimplemented(cls, body: Any) -> Any:
        refuse_unimplemented(body, set(cls.model_fields))
        return body

    def num_prompt_logprobs(self) -> int | None:
        """Top-N of prompt tokens the engine computes."""
        return self.prompt_logprobs
