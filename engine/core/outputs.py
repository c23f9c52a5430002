"""What the engine hands back: one ``RequestOutput`` per request per step (or at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# One sampled position's log-probabilities: token id -> logprob. It always holds the chosen
# token, plus the top-N when ``SamplingParams.logprobs = N``.
Logprobs = dict[int, float]


class Logprob(NamedTuple):
    """A prompt token's log-probability and its rank in the model's distribution (1: the
    most likely)."""

    logprob: float
    rank: int


# ``SamplingParams.prompt_logprobs = N``: per prompt token, its logprob and the top-N of the
# distribution it was drawn from; None for the first token (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request.

    With ``output_kind="delta"`` the lists and ``text`` hold only what is new since the previous
    output; otherwise everything so far.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop_token_ids id or stop string (EOS: None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None  # once the prompt is computed
