"""Drawing sampled tokens: top-k, top-p (nucleus) and min-p, then one uniform number per row.

A row's token is found by inverting its distribution's cumulative sum at a uniform draw ``u``
(the first token whose cumulative probability passes ``u``), with its candidates in token-id
order, so a row's token depends only on its own logits, settings and ``u`` (a seeded row draws
``u`` from its own generator: the same tokens whatever else is in the batch).

Nothing here sorts a whole vocabulary. Rows are grouped by what they need: ``top_k``
candidates (``torch.topk``, then top-p among them), a top-p nucleus without top-k (the smallest
probability it keeps, from ``ops.top_p_threshold``: on a CPU a C kernel that histograms the
probabilities instead of sorting them), or the whole vocabulary (plain temperature). The draw
sums blocks of a row instead of taking a cumulative sum over all of it. On two Zen 4 cores, 32
rows of a 151,936-token vocabulary took 124 ms (temperature only) and 389 ms (top-k 20 and
top-p 0.8) with an exponential race over the whole vocabulary after a full sort; the figures
now: ``load_tests/sampling_bench.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.core.sampling_params import SamplingParams
from kernels import ops

BLOCK = 1024  # a draw over more than 4 blocks finds its block first, then the token in it
NUCLEUS = -1  # the group of top-p rows without top-k


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           u: torch.Tensor) -> torch.Tensor:
    """Token ids [rows] drawn from ``logits`` [rows, vocab] (temperature already applied)
    under each row's top-k, top-p and min-p, at the uniform draws ``u`` [rows] (float64)."""
    vocab = logits.shape[-1]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        k = min(p.top_k, vocab) if p.top_k > 0 else (NUCLEUS if p.top_p < 1.0 else 0)
        groups.setdefault(k, []).append(i)
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
    """``sample`` for rows that all take their ``k`` most likely tokens (then top-p among
    them), or top-p rows without top-k (``NUCLEUS``), or the whole vocabulary (0)."""
    top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=torch.float32)
    if k <= 0:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        if k == NUCLEUS:  # the nucleus: every token at least as likely as its last one
            probs = probs.masked_fill(probs < ops.top_p_threshold(probs, top_p).unsqueeze(1), 0.0)
        return _draw(_min_p(probs, params), u)
    vals, ids = logits.topk(k, dim=-1)  # descending
    probs = torch.softmax(vals, dim=-1, dtype=torch.float32)
    keep = probs.cumsum(dim=-1) - probs < top_p.unsqueeze(1)  # mass before each token
    return _pick(vals, ids, keep, params, u)


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
    target = u * sums.sum(dim=-1)
    b, before = _invert(sums, target)
    inner = blocks[torch.arange(rows, device=probs.device), b]
    j, _ = _invert(inner, target - before)
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
