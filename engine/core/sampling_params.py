"""Per-request sampling settings, mirroring vLLM's ``SamplingParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeGuard

from engine.grammar.structured_output import StructuredOutputsParams

OutputKind = Literal["cumulative", "delta", "final"]

MAX_LOGPROBS = 20
MAX_N = 1024  # sequences of one request (the Router bounds it further: max_n)
MAX_TEMPERATURE = 100.0
MAX_STOP = 64  # stop strings of one request
MAX_STOP_LEN = 1024  # characters of one stop string (the detokenizer holds that much back)
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128
MAX_WORD_LEN = 1024  # characters of one bad word, or of a cache salt
MAX_BIAS = 100.0  # logit_bias values lie in [-MAX_BIAS, MAX_BIAS], as OpenAI's API takes them
INT32_MAX = 2 ** 31 - 1
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
    prompt_logprobs: int | None = None  # top-N of every prompt position (the first is None)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    detokenize: bool = True
    skip_special_tokens: bool = True
    output_kind: OutputKind = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last N tokens
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (engine.sample.logits_processors)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, its type and its accepted range.

        Every field is checked for type and both bounds, so nothing that reaches a batched step
        (where one bad value would fail every request in the batch) can overflow a tensor or
        index outside one. ``bool`` is not accepted where an integer or a number is expected.
        """
        _int_field("n", self.n, 1, MAX_N)
        _float_field("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _float_field("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _int_field("top_k", self.top_k, -1, INT32_MAX)  # 0 and -1: off
        _float_field("min_p", self.min_p, 0.0, 1.0)
        _int_field("seed", self.seed, _SEED_MIN, _SEED_MAX, optional=True)
        _int_field("max_tokens", self.max_tokens, 0, INT32_MAX, optional=True)  # 0: prompt only
        _int_field("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens",
                   self.min_tokens)
        _int_field("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        _int_field("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, optional=True)
        _int_field("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, INT32_MAX, True)
        _check_extras(self)
        for name in ("presence_penalty", "frequency_penalty"):
            _float_field(name, getattr(self, name), -2.0, 2.0)
        _float_field("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        for name in ("ignore_eos", "include_stop_str_in_output", "detokenize",
                     "skip_special_tokens"):
            _check(type(getattr(self, name)) is bool, name, "must be a bool", getattr(self, name))
        _check(isinstance(self.stop, list), "stop", "must be a list of strings", self.stop)
        _check(isinstance(self.stop_token_ids, list), "stop_token_ids", "must be a list",
               self.stop_token_ids)
        _check(len(self.stop) <= MAX_STOP, "stop", f"takes at most {MAX_STOP} strings",
               len(self.stop))
        _check(all(type(s) is str and 0 < len(s) <= MAX_STOP_LEN for s in self.stop), "stop",
               f"must be non-empty strings of at most {MAX_STOP_LEN} characters", self.stop)
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"takes at most {MAX_STOP_TOKEN_IDS} ids", len(self.stop_token_ids))
        _check(all(_is_int(t) and 0 <= t <= INT32_MAX for t in self.stop_token_ids),
               "stop_token_ids", f"must be integer token ids in [0, {INT32_MAX}]",
               self.stop_token_ids)
        _check(self.output_kind in ("cumulative", "delta", "final"), "output_kind",
               "must be 'cumulative', 'delta' or 'final'", self.output_kind)
        if self.structured_outputs is not None:
            _check(isinstance(self.structured_outputs, StructuredOutputsParams),
                   "structured_outputs", "must be a StructuredOutputsParams",
                   self.structured_outputs)
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        _fail(name, rule, value)


def _fail(name: str, rule: str, value: object) -> NoReturn:
    raise ValueError(f"{name} {rule}, got {_short(value)}")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _as_list(name: str, value: object) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list, got {_short(value)}")
    return list(value)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(name: str, value: object, low: int, high: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        _fail(name, "must be an integer", value)
    _check(low <= value <= high, name, f"must be in [{low}, {high}]", value)


def _float_field(name: str, value: object, low: float, high: float,
                 low_open: bool = False) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        _fail(name, "must be a finite number", value)
    above = value > low if low_open else value >= low
    _check(above and value <= high, name,
           f"must be in {'(' if low_open else '['}{low:g}, {high:g}]", value)


def _is_id(t: object) -> bool:
    return _is_int(t) and 0 <= t <= INT32_MAX


def _is_bias(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and -MAX_BIAS <= v <= MAX_BIAS)


def _check_extras(p: SamplingParams) -> None:
    """vLLM's logits-processor fields and ``cache_salt``."""
    allowed = p.allowed_token_ids
    _check(allowed is None or (isinstance(allowed, list) and bool(allowed)
                               and all(map(_is_id, allowed))),
           "allowed_token_ids", f"must be a non-empty list of token ids in [0, {INT32_MAX}]",
           allowed)
    words = p.bad_words
    _check(words is None or (isinstance(words, list) and len(words) <= MAX_BAD_WORDS and all(
        isinstance(w, str) and w.strip() and len(w) <= MAX_WORD_LEN for w in words)),
           "bad_words", f"must be a list of at most {MAX_BAD_WORDS} non-blank strings of at "
           f"most {MAX_WORD_LEN} characters", words)
    bias = p.logit_bias
    _check(bias is None or (isinstance(bias, dict) and all(map(_is_id, bias))
                            and all(map(_is_bias, bias.values()))),
           "logit_bias", f"must map token ids in [0, {INT32_MAX}] to numbers in "
           f"[{-MAX_BIAS:g}, {MAX_BIAS:g}]", bias)
    salt = p.cache_salt
    _check(salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_WORD_LEN),
           "cache_salt", f"must be a non-empty string of at most {MAX_WORD_LEN} characters", salt)
