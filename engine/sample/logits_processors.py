"""vLLM's per-request logits processors beside the sampler's own: ``allowed_token_ids`` (only
those ids can be sampled), ``bad_words`` (their token sequences are never generated) and
OpenAI's ``logit_bias`` (a number added to chosen tokens' logits); their checks against the
vocabulary and the bad words' tokenization (the fields' own checks live with
``SamplingParams``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.core.request import Request

def check_vocab_ids(p: Any, vocab_size: int) -> None:
    """Token ids of ``p`` index the logits: each must be below ``vocab_size`` (one bad id would
    fail the whole step)."""
    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        outside = [t for t in getattr(p, name) or () if t >= vocab_size]
        if outside:
            raise ValueError(f"{name} must be in [0, {vocab_size - 1}], got {outside[:5]}")


def bad_words_ids(tokenizer: Any, words: Sequence[str] | None) -> list[list[int]]:
    """Each bad word's token ids, as vLLM tokenizes them: the word without leading spaces,
    and, where it tokenizes differently into as many tokens, the word after a space (its
    spelling inside a text)."""
    out: list[list[int]] = []
    for word in words or ():
        bare = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def banned_tokens(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word's always, a longer
    word's last token when the output ends with the rest of the word."""
    banned = []
    for word in bad_words:
        prefix = word[:-1]
        if not prefix or output[-len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


class RowTensors:
    """Each request's ``allowed_token_ids`` and ``logit_bias`` as tensors, built at its first
    step and kept until ``forget``: building them every step from lists of up to a vocabulary's
    size took ~20-30 ms (150,000 ids), and that would slow every request in the batch."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, torch.Tensor]] = {}

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, r: Request, device: torch.device) -> dict[str, torch.Tensor]:
        row = self._rows.get(r.request_id)
        if row is None:
            p, row = r.params, {}
            if p.allowed_token_ids is not None:
                row["allowed"] = torch.tensor(p.allowed_token_ids, device=device)
            if p.logit_bias:
                row["bias_ids"] = torch.tensor(list(p.logit_bias), device=device)
                row["bias"] = torch.tensor(list(p.logit_bias.values()), device=device)
            self._rows[r.request_id] = row
        return row

    def apply_logit_bias(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """In place on ``logits`` [rows, vocab]: add each row's ``logit_bias`` to its tokens."""
        for i, r in enumerate(reqs):
            if r.params.logit_bias:
                row = self.get(r, logits.device)
                logits[i, row["bias_ids"]] += row["bias"].to(logits.dtype)

    def apply_masks(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """In place on ``logits`` [rows, vocab]: forbid every token outside a row's
        ``allowed_token_ids`` and every token that would complete one of its bad words."""
        for i, r in enumerate(reqs):
            if r.params.allowed_token_ids is not None:
                ids = self.get(r, logits.device)["allowed"]
                keep = logits[i, ids]
                logits[i] = float("-inf")
                logits[i, ids] = keep
            if r.bad_words:
                banned = banned_tokens(r.bad_words, r.output_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")


class SeenTokens:
    """The penalties' view of each running request, kept up to date a step at a time: the
    distinct tokens of its prompt and output (repetition penalty) and the counts of its output
    tokens (presence and frequency penalties). Rebuilding them from the whole sequence every
    step, row by row, cost ~5 ms a step for 32 rows of 1,500 tokens on Zen 4; now each row adds
    its new tokens and the batch's penalties are applied in one indexed update each."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[list[int], set[int], dict[int, int], list[int]]] = {}

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, r: Request) -> tuple[list[int], dict[int, int]]:
        """The distinct tokens so far (first seen first) and the output tokens' counts."""
        row = self._rows.get(r.request_id)
        if row is None:
            row = self._rows[r.request_id] = ([], set(), {}, [0, 0])
        distinct, seen, counts, done = row
        tokens = r.all_token_ids
        for t in tokens[done[0]:]:
            if t not in seen:
                seen.add(t)
                distinct.append(t)
        new_out = tokens[r.num_prompt_tokens + done[1]:]
        for t in new_out:
            counts[t] = counts.get(t, 0) + 1
        done[0], done[1] = len(tokens), done[1] + len(new_out)
        return distinct, counts

    def apply(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """In place on ``logits`` [rows, vocab]: each row's repetition penalty on the tokens
        it has seen (divides a positive logit, multiplies a negative one), then its presence
        and frequency penalties on its output tokens."""
        rep_rows: list[int] = []  # rows with a repetition penalty, their penalties and counts
        rep: list[float] = []
        rep_lens: list[int] = []
        rep_ids: list[int] = []
        out_rows: list[int] = []
        out_ids: list[int] = []
        out_sub: list[float] = []
        for i, r in enumerate(reqs):
            p = r.params
            if not p.needs_penalties:
                continue
            distinct, counts = self._row(r)
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
                rep.append(p.repetition_penalty)
                rep_lens.append(len(distinct))
                rep_ids += distinct
            if counts and (p.presence_penalty or p.frequency_penalty):
                out_rows += [i] * len(counts)
                out_ids += counts
                out_sub += [p.frequency_penalty * c + p.presence_penalty for c in counts.values()]
        dev = logits.device
        if rep_ids:
            lens = torch.tensor(rep_lens, device=dev)
            at = (torch.tensor(rep_rows, device=dev).repeat_interleave(lens),
                  torch.tensor(rep_ids, device=dev))
            scores = logits[at]
            penalty = torch.tensor(rep, device=dev, dtype=logits.dtype).repeat_interleave(lens)
            logits[at] = torch.where(scores > 0, scores / penalty, scores * penalty)
        if out_ids:
            at = (torch.tensor(out_rows, device=dev), torch.tensor(out_ids, device=dev))
            logits[at] -= torch.tensor(out_sub, device=dev, dtype=logits.dtype)
