"""The prepared request: what the Router knows of a completion or chat request once it is
checked and tokenized, and all that the rest of its path reads.

``PromptProcessor.prepare_completion`` and ``prepare_chat`` (``serve_app/router/prompts.py``)
make one from the pydantic request; from there on the Router's path (admission, the batcher's
``EngineRequest``s, the response stream and the formatter) reads this record and never the
request body again. Each prompt's ``SamplingParams`` was built once, with the model's defaults
merged in beforehand, and so checked once (``serve_app/protocol/sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from engine import SamplingParams
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest
from serve_app.protocol.tools import ToolPlan


@dataclass(frozen=True)
class OutputSpec:
    """How the answer is shaped: the endpoint's format, streaming, stops and what the choices
    carry."""

    kind: Literal["completion", "chat"]
    n: int  # choices per prompt
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    usage_in_every_chunk: bool  # vLLM's continuous_usage_stats
    stop: list[str]  # stop strings: matched in the Router, never sent to the engine
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    num_logprobs: int | None  # top-N logprobs of each sampled token (None: no logprobs)
    prompt_logprobs: bool  # the response carries the prompt's logprobs
    return_token_ids: bool  # vLLM's: choices carry token ids, the response the prompt's
    tokens_as_ids: bool  # vLLM's return_tokens_as_token_ids: "token_id:<id>" in logprobs
    echo_texts: list[str] | None = None  # completions' echo: each prompt's text
    echo_logprobs: int | None = None  # completions' echo with logprobs: the prompt's top-N
    tools: ToolPlan | None = None  # chat's tools: text is parsed for calls


@dataclass(frozen=True)
class PreparedRequest:
    """One HTTP request, ready for the engine: per prompt its token ids and its parameters."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt, built once each
    output: OutputSpec

    @property
    def num_seqs(self) -> int:
        """Sequences it asks for (prompts x n): what admission counts."""
        return len(self.prompts) * self.output.n


def _common(req: CompletionRequest | ChatCompletionRequest,
            num_logprobs: int | None) -> OutputSpec:
    return OutputSpec(
        "completion" if isinstance(req, CompletionRequest) else "chat", req.n, req.stream,
        req.include_usage, req.usage_in_every_chunk, req.stop_list(),
        req.include_stop_str_in_output, req.skip_special_tokens, num_logprobs,
        req.prompt_logprobs is not None, req.return_token_ids, req.return_tokens_as_token_ids)


def completion_output(req: CompletionRequest, echo_texts: list[str] | None) -> OutputSpec:
    """A completion's answer: its logprobs, and with ``echo`` the prompts' texts (and with
    logprobs their top-N)."""
    spec = _common(req, req.logprobs)
    return replace(spec, echo_texts=echo_texts,
                   echo_logprobs=req.logprobs if req.echo else None)


def chat_output(req: ChatCompletionRequest, tools: ToolPlan | None) -> OutputSpec:
    """A chat answer: its logprobs (``top_logprobs``) and its tool plan."""
    spec = _common(req, req.num_logprobs())
    return replace(spec, tools=tools)
