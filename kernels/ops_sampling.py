"""The sampler's entry points behind ``kernels.ops``: grammar masks, greedy tokens and top-p
thresholds over rows of logits, by the C kernels on CPU rows they take, else in torch."""

from __future__ import annotations

import torch

from kernels import cpu_kernels as _lib
from kernels import cpu_launchers as _cpu
from kernels.settings import use_cpu as _use_cpu


def can_mask_logits(logits: torch.Tensor) -> bool:
    """Whether ``mask_logits`` takes these logits (the C kernel: CPU, float32 or bfloat16)."""
    return _use_cpu(logits) and _cpu.supports_mask(logits)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Grammar masks in place: ``logits[r, t] = -inf`` where bit t of ``bitmask[r]`` (an int32
    token bitmask, 32 tokens a word) is 0, for r in ``rows`` (``can_mask_logits`` first)."""
    _cpu.mask_logits(logits, bitmask, rows)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (int64 [rows]; the first of equal maxima):
    ``logits.max(dim=-1).indices``, by the C kernel on CPU rows it takes (torch's reduction
    runs at a fifth of the memory's speed on a float32 vocabulary-wide row)."""
    if not (_use_cpu(logits) and _cpu.supports_mask(logits)):
        return logits.max(dim=-1).indices
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _lib.call("argmax_rows_cpu", out.data_ptr(), logits.data_ptr(), logits.shape[0],
              logits.shape[1], logits.stride(0), _lib.DTYPES[logits.dtype],
              torch.get_num_threads())
    return out


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [rows, vocab] (float32, each row a distribution up to its total),
    the smallest probability its top-p nucleus keeps (tokens from the most likely down, each
    kept while the mass before it is below ``top_p`` [rows] times the total): every token with
    probability >= it is in the nucleus. On CPU rows the C kernel (no sort of the vocabulary);
    elsewhere a sort."""
    if _use_cpu(probs) and probs.dtype == torch.float32 and _cpu.supports_mask(probs):
        tau = torch.empty(probs.shape[0], dtype=torch.float32)
        limits = top_p.to(torch.float32).contiguous()
        _lib.call("top_p_threshold_cpu", tau.data_ptr(), probs.data_ptr(), probs.shape[0],
                  probs.shape[1], probs.stride(0), limits.data_ptr(), torch.get_num_threads())
        return tau
    return top_p_threshold_ref(probs, top_p)


def top_p_threshold_ref(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ranked = probs.sort(dim=-1, descending=True).values
    before = ranked.double().cumsum(dim=-1) - ranked.double()
    want = top_p.double() * probs.double().sum(dim=-1)
    kept = (before < want.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    return ranked.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)
