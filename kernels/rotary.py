"""Rotary position embedding (NeoX / Hugging Face Llama layout), applied to q and k in place.

cos_sin_cache [max_position, head_size] float32 holds cos in its first half and sin in its second
half (rotary_dim == head_size). With x1 = x[..., :D/2] and x2 = x[..., D/2:]:
out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, computed in float32.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton  # noqa: F401  (kernel added next)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> None:
    heads = x.view(x.shape[0], -1, head_size)
    half = head_size // 2
    x1 = heads[..., :half].float()
    x2 = heads[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    heads.copy_(out)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    """positions [T]; query [T, Hq*D], key [T, Hk*D] rotated in place."""
    half = head_size // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()  # [T, D]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    _rotate_ref(query, cos, sin, head_size)
    _rotate_ref(key, cos, sin, head_size)
