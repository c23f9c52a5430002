"""Per-request sampling settings, mirroring vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

OutputKind = Literal["cumulative", "delta", "final"]

_MAX_LOGPROBS = 20
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # torch generators take seed + index < 2**64


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``output_kind`` says what each streamed ``RequestOutput`` holds: everything so far
    (``cumulative``), only what is new since the last one (``delta``), or one output at the end
    (``final``). ``detokenize=False`` skips text (stop strings are then the caller's job).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: OutputKind = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field and its accepted range."""
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1",
               self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.seed is None or _SEED_MIN <= self.seed <= _SEED_MAX, "seed",
               "must fit in a signed 64-bit integer", self.seed)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens",
                   self.min_tokens)
        _check(self.logprobs is None or 0 <= self.logprobs <= _MAX_LOGPROBS, "logprobs",
               f"must be in [0, {_MAX_LOGPROBS}]", self.logprobs)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]",
               self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]",
               self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]",
               self.repetition_penalty)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative token ids", self.stop_token_ids)
        _check(self.output_kind in ("cumulative", "delta", "final"), "output_kind",
               "must be 'cumulative', 'delta' or 'final'", self.output_kind)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
