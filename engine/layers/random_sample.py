"""Drawing sampled tokens: top-k, top-p (nucleus) and min-p, then one uniform number per row.

A row's token is found by inverting its distribution's cumulative sum at a uniform draw ``u``
(the first token whose cumulative probability passes ``u``), with its candidates in token-id
order, so a row's token depends only on its own logits, settings and ``u`` (a seeded row draws
``u`` from its own generator: the same tokens whatever else is in the batch).

Nothing here sorts a whole vocabulary unless it must. Rows are grouped by how many candidates
they need: ``top_k`` (``torch.topk``, not a sort), ``PROBES`` for a top-p row without top-k (its
nucleus is almost always within the most likely 1,024 tokens; when their mass is below
``top_p`` the row looks at 16,384, then sorts its whole vocabulary), or none at all (plain
temperature: the whole vocabulary, unsorted). On two Zen 4 cores, 32 rows of a 151,936-token vocabulary took 117 ms
(temperature only) and 372 ms (top-k 20 or top-p 0.8) with an exponential race over the whole
vocabulary after a full sort; see ``load_tests/sampling_bench.py`` for the figures now.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.sampling_params import SamplingParams

PROBES = (1024, 16384)  # candidates a top-p row without top-k looks at, widening, before
# it sorts its whole vocabulary
BLOCK = 1024  # a draw over more than 4 blocks finds its block first, then the token in it


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           u: torch.Tensor) -> torch.Tensor:
    """Token ids [rows] drawn from ``logits`` [rows, vocab] (temperature already applied)
    under each row's top-k, top-p and min-p, at the uniform draws ``u`` [rows] (float64)."""
    vocab = logits.shape[-1]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        k = p.top_k if p.top_k > 0 else (PROBES[0] if p.top_p < 1.0 else 0)
        groups.setdefault(min(k, vocab), []).append(i)
    return _by_group(logits, params, u, groups)


def _by_group(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor,
              groups: dict[int, list[int]]) -> torch.Tensor:
    if len(groups) == 1:
        ((k, _),) = groups.items()
        return sample_group(logits, params, u, k)
    out = torch.empty(len(params), dtype=torch.long, device=logits.device)
    for k, rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = sample_group(logits[idx], [params[i] for i in rows], u[idx], k)
    return out


def sample_group(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor,
                 k: int) -> torch.Tensor:
    """``sample`` for rows that all look at their ``k`` most likely tokens (0: the whole
    vocabulary, no top-k or top-p)."""
    if k == 0:
        return _draw(_min_p(torch.softmax(logits, dim=-1), params), u)
    dev, vocab = logits.device, logits.shape[-1]
    vals, ids = logits.topk(k, dim=-1)  # descending
    top_k = torch.tensor([p.top_k > 0 for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
    # top-p is measured on the top-k distribution where there is one, else on the whole one
    norm = vals.logsumexp(dim=-1)
    if not bool(top_k.all()):
        norm = torch.where(top_k, norm, logits.logsumexp(dim=-1))
    probs = (vals - norm.unsqueeze(1)).exp()
    keep = probs.cumsum(dim=-1) - probs < top_p.unsqueeze(1)  # mass before each token
    if k == vocab:
        return _pick(vals, ids, keep, params, u)
    # a top-p row whose candidates hold less than top-p: its nucleus reaches past them
    wider = (~top_k & (probs.sum(dim=-1) < top_p)).tolist()
    if not any(wider):
        return _pick(vals, ids, keep, params, u)
    next_k = next((w for w in PROBES if w > k), vocab)
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(wider):
        groups.setdefault(min(next_k, vocab) if w else -1, []).append(i)
    out = torch.empty(len(params), dtype=torch.long, device=dev)
    for width, rows in groups.items():
        idx = torch.tensor(rows, device=dev)
        sub = [params[i] for i in rows]
        out[idx] = (_pick(vals[idx], ids[idx], keep[idx], sub, u[idx]) if width < 0
                    else sample_group(logits[idx], sub, u[idx], width))
    return out


def _pick(vals: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor,
          params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    probs = _min_p(torch.softmax(vals.masked_fill(~keep, float("-inf")), dim=-1), params)
    ids, order = ids.sort(dim=-1)  # token-id order: the draw depends on the kept set only
    chosen = _draw(probs.gather(1, order), u)
    return ids.gather(1, chosen.unsqueeze(1)).squeeze(1)


def _min_p(probs: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    if not any(p.min_p > 0 for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], device=probs.device, dtype=probs.dtype)
    return probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first column whose cumulative probability passes ``u`` times the row's
    total; never a column of probability 0. A wide row finds the block first (block sums:
    no cumulative sum over the whole row), then the column in it."""
    rows, n = probs.shape
    u = u.to(torch.float64)
    if n <= 4 * BLOCK:
        return _invert(probs, u * probs.sum(dim=-1, dtype=torch.float64))[0]
    size = _block_size(n, BLOCK)
    blocks = (probs if n % size == 0 else F.pad(probs, (0, -n % size))).view(rows, -1, size)
    sums = blocks.sum(dim=-1).to(torch.float64)  # (summing in float64 took 40x longer)
    b, before = _invert(sums, u * sums.sum(dim=-1))
    inner = blocks[torch.arange(rows, device=probs.device), b]
    j, _ = _invert(inner, u * sums.sum(dim=-1) - before)
    return b * size + j


@functools.cache
def _block_size(n: int, block: int) -> int:
    """A divisor of ``n`` near ``block`` (no padded copy of the row), else ``block``."""
    near = [d for d in range(max(2, block // 4), 2 * block + 1) if n % d == 0]
    return min(near, key=lambda d: abs(d - block)) if near else block


def _invert(weights: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the first column whose cumulative weight passes ``target``, kept to the last
    column of weight > 0 (rounding), and the weight before it."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)
    last = (weights > 0).cumsum(dim=-1).argmax(dim=-1)  # the first column of the final count
    idx = torch.minimum(idx, last)
    before = cdf.gather(1, idx.unsqueeze(1)).squeeze(1) - weights.gather(
        1, idx.unsqueeze(1)).squeeze(1).to(torch.float64)
    return idx, before
