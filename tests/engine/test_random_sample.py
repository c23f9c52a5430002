"""``engine.sample.random_sample``: the token a uniform draw picks, against a reference that
sorts the whole vocabulary (top-k, then top-p on what top-k kept, then min-p), on every path:
the whole vocabulary, ``torch.topk`` candidates, the top-p nucleus (the C kernel's threshold and
the sort that stands in for it elsewhere), the draw by blocks."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.sample import random_sample
from engine.sample.random_sample import _draw, sample
from kernels import ops


def reference(logits: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row, the slow way: the kept tokens' renormalized probabilities in token-id order,
    inverted at ``u``."""
    vocab = logits.shape[-1]
    order = logits.argsort(descending=True)
    ranked = logits[order]
    keep = torch.ones(vocab, dtype=torch.bool)
    if p.top_k > 0:
        keep[p.top_k:] = False
    probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs.cumsum(-1) - probs < p.top_p
    probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    by_id = torch.zeros(vocab, dtype=torch.float64).scatter_(0, order, probs.double())
    cdf = by_id.cumsum(-1)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                  right=True).clamp(max=vocab - 1))


def test_draw_inverts_the_cumulative_sum_and_never_picks_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]] * 5)
    u = torch.tensor([0.0, 0.49, 0.5, 0.8, 0.999999], dtype=torch.float64)
    assert _draw(probs, u).tolist() == [0, 0, 2, 3, 3]
    unnormalized = torch.tensor([[0.0, 2.0, 0.0, 2.0]] * 3)  # scaled by the row's total
    assert _draw(unnormalized, torch.tensor([0.0, 0.5, 0.75], dtype=torch.float64)).tolist() \
        == [1, 3, 3]
    # at the very top (u rounding to the total) the last token with a probability, never
    # the zeros after it
    tail = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    assert _draw(tail, torch.tensor([1.0], dtype=torch.float64)).tolist() == [1]


@pytest.mark.parametrize("columns", [53, 60])  # 60: blocks of 5 (a divisor), no padding
def test_a_wide_row_finds_its_block_then_its_token(monkeypatch, columns):
    monkeypatch.setattr(random_sample, "BLOCK", 4)  # rows over 16 tokens go by blocks
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(6, columns, generator=gen) * (torch.rand(6, columns, generator=gen) > 0.5)
    probs[:, 45:] = 0.0  # trailing zeros; 53 columns: no divisor near 4, a padded last block
    for _ in range(200):
        u = torch.rand(6, generator=gen, dtype=torch.float64)
        cdf = probs.double().cumsum(-1)
        want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        assert _draw(probs, u).tolist() == want.tolist()
    assert _draw(probs, torch.ones(6, dtype=torch.float64)).tolist() == [
        int(row.nonzero().max()) for row in probs]


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.5),
    SamplingParams(temperature=1.0, top_p=0.3),  # a peaked row: a token or two
    SamplingParams(temperature=1.0, top_p=0.95),  # a flat row: most of the vocabulary
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.5),
    SamplingParams(temperature=1.0, top_k=1000),  # more than the vocabulary
    SamplingParams(temperature=1.0, top_p=0.4),
]


@pytest.mark.parametrize("block", [1024, 4])  # 4: wide rows (over 16) draw by blocks
@pytest.mark.parametrize("threshold", ["kernel", "sort"])
def test_every_path_picks_the_reference_token(monkeypatch, block, threshold):
    monkeypatch.setattr(random_sample, "BLOCK", block)
    if threshold == "sort":
        monkeypatch.setattr(ops, "top_p_threshold", ops.top_p_threshold_ref)
    gen = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(len(PARAMS), vocab, generator=gen, dtype=torch.float64)
    logits[3] *= 6.0  # peaked: its top-p 0.3 nucleus is a token or two
    for _ in range(150):
        u = torch.rand(len(PARAMS), generator=gen, dtype=torch.float64)
        got = sample(logits, PARAMS, u).tolist()
        assert got == [reference(logits[i], p, float(u[i])) for i, p in enumerate(PARAMS)]


def test_a_row_s_token_does_not_depend_on_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), 64, generator=gen)
    u = torch.rand(len(PARAMS), generator=gen, dtype=torch.float64)
    together = sample(logits, PARAMS, u).tolist()
    for i, p in enumerate(PARAMS):
        assert sample(logits[i:i + 1], [p], u[i:i + 1]).tolist() == [together[i]]
        pair = [SamplingParams(temperature=1.0, top_k=7), p]
        assert sample(logits[[0, i]], pair, u[[0, i]]).tolist()[1] == together[i]


@pytest.mark.parametrize("kwargs, allowed", [
    ({}, {0, 1, 2, 3}), ({"top_k": 2}, {0, 1}), ({"top_p": 0.75}, {0, 1}),
    ({"min_p": 0.35}, {0, 1}), ({"top_k": 3, "top_p": 0.6}, {0, 1}), ({"top_k": 3, "top_p": 0.5}, {0}),
])
def test_the_kept_tokens_are_drawn_in_proportion(kwargs, allowed):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs).repeat(20000, 1)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    params = [SamplingParams(temperature=1.0, **kwargs)] * 20000
    counts = torch.bincount(sample(logits, params, u), minlength=4).double() / 20000
    kept = torch.tensor([float(i in allowed) for i in range(4)]) * probs
    assert counts.tolist() == pytest.approx((kept / kept.sum()).tolist(), abs=0.015)
