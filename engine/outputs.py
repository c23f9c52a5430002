"""What the engine hands back: one ``RequestOutput`` per request per step (or at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field

# One sampled position's log-probabilities: token id -> logprob. It always holds the chosen
# token, plus the top-N when ``SamplingParams.logprobs = N``.
Logprobs = dict[int, float]


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
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

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
