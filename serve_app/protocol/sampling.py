"""A request's sampling fields as the engine takes them: the model's defaults merged in, then
``SamplingParams`` built, and so checked, once.

The request models (``serve_app/protocol/requests.py``) check types, the fields the Router
reads before the engine's parameters exist (``n``, ``max_tokens``, ``truncate_prompt_tokens``,
``top_logprobs``), ``seed``'s 64 bits, OpenAI's own ranges (``temperature`` in [0, 2], ``logit_bias`` values, stop
strings) and checks across fields. Every other range is ``SamplingParams``' own check, run when
``sampling_params`` builds it: its ``ValueError`` names the field, and becomes the 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from engine import SamplingParams, StructuredOutputsParams
from serve_app.protocol.constraints import constraint
from serve_app.protocol.errors import APIError, FieldError
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest, SamplingRequest

# The fields a model's generation_config.json may default (max_tokens aside: the Router bounds
# it with the prompt's length, ``PromptProcessor.params``); request and engine share the names.
DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

R = TypeVar("R", bound=SamplingRequest)


def with_defaults(req: R, defaults: Mapping[str, object]) -> R:
    """``req`` with the model's defaults in the sampling fields it left unset (what the client
    set always wins); ``req`` itself when no default applies. Nothing is checked here: the
    merged values are checked once, by ``SamplingParams``."""
    unset = {k: defaults[k] for k in DEFAULTABLE
             if k in defaults and k not in req.model_fields_set}
    return req.model_copy(update=unset) if unset else req


def structured_outputs(req: CompletionRequest | ChatCompletionRequest,
                       ) -> StructuredOutputsParams | None:
    """What constrains the output: a tool choice, ``structured_outputs`` or a JSON
    ``response_format`` (``serve_app.protocol.constraints``)."""
    plan = req.tool_plan() if isinstance(req, ChatCompletionRequest) else None
    return constraint(req.structured_outputs, req.response_format, plan)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    num_logprobs: int | None) -> SamplingParams:
    """Engine parameters for one prompt, built (and validated) once: delta token ids only;
    stop strings stay in the Router. A value ``SamplingParams`` refuses is a 400 naming it."""
    try:
        so = structured_outputs(req)
    except FieldError as e:
        raise APIError(400, f"{e.field}: {e}", param=e.field) from None
    try:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos, logprobs=num_logprobs,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, skip_special_tokens=req.skip_special_tokens,
            detokenize=False, output_kind="delta",
            structured_outputs=so, prompt_logprobs=req.num_prompt_logprobs(),
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
            logit_bias=req.logit_bias_ids(), cache_salt=req.cache_salt,
        )
    except ValueError as exc:
        message = str(exc)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from None
