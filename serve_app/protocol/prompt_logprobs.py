"""Prompt logprobs in responses: vLLM's ``prompt_logprobs`` field and the echoed prompt's
``logprobs`` of a completion (``echo`` with ``logprobs``, as lm-evaluation-harness asks for).

The engine scores every prompt token but the first (``engine.core.outputs.PromptLogprobs``); they
reach the Router with the request's ``DonePart``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine import PromptLogprobs

Prompt = tuple[list[int], PromptLogprobs | None]  # a prompt's token ids and their logprobs
TokenText = Callable[[int], str]


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf: clamp like vLLM


def prompt_logprobs_json(lps: PromptLogprobs, token_text: TokenText,
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token
    ``{token id: {"logprob", "rank", "decoded_token"}}`` (the token and the top-N)."""
    return [None if entry is None else {
        str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": token_text(t)}
        for t, lp in entry.items()} for entry in lps]


def echo_logprobs(prompt: Prompt, num: int, generated: dict[str, Any],
                  token_text: TokenText) -> dict[str, Any]:
    """A completion choice's ``logprobs`` with its echoed prompt's in front: the prompt's first
    token has no logprob and no top logprobs (None), the others their own and the top
    ``num``; text offsets run from the prompt's start through the generated tokens."""
    ids, lps = prompt
    tokens = [token_text(t) for t in ids]
    token_lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for t, entry in zip(ids[1:], (lps or [])[1:], strict=False):
        if entry is None:
            continue
        token_lps.append(_finite(entry[t].logprob))
        tops.append({token_text(i): _finite(lp.logprob) for i, lp in entry.items()
                     if i == t or lp.rank <= num})
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens + generated["tokens"],
            "token_logprobs": token_lps + generated["token_logprobs"],
            "top_logprobs": tops + generated["top_logprobs"],
            "text_offset": offsets + [offset + o for o in generated["text_offset"]]}
