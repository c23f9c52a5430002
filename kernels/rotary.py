"""Rotary position embedding (NeoX / Hugging Face Llama layout), applied to q and k in place.

cos_sin_cache [max_position, head_size] float32 holds cos in its first half and sin in its second
half (rotary_dim == head_size). With x1 = x[..., :D/2] and x2 = x[..., D/2:]:
out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, computed in float32.
"""

from __future__ import annotations

import torch

from kernels._triton import next_power_of_2, tl, triton


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


@triton.jit
def _rotate_heads(
    x_row,  # pointer to one token's [H, D] heads, head stride D, contiguous
    cos,  # [1, HALF_PAD] float32
    sin,  # [1, HALF_PAD] float32
    num_heads,
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,  # next power of two >= D / 2
    BLOCK_H: tl.constexpr,  # next power of two >= num_heads
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    p1 = x_row + heads * (2 * HALF) + cols
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_row.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(x_row.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int32/int64
    q_ptr,  # [T, Hq*D] rotated in place, rows strided by stride_q, last dim contiguous
    k_ptr,  # [T, Hk*D] rotated in place, rows strided by stride_k, last dim contiguous
    cos_sin_ptr,  # [max_position, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    stride_q,  # row stride of q (elements)
    stride_k,  # row stride of k
    stride_cache,  # row stride of cos_sin_cache
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # D / 2
    HALF_PAD: tl.constexpr,  # next power of two >= D / 2 (D = 80, 96 need the mask)
    BLOCK_HQ: tl.constexpr,  # next power of two >= Hq
    BLOCK_HK: tl.constexpr,  # next power of two >= Hk
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    cache_row = cos_sin_ptr + pos * stride_cache
    cos = tl.load(cache_row + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + tok * stride_q, cos, sin, num_q_heads, HALF, HALF_PAD, BLOCK_HQ)
    _rotate_heads(k_ptr + tok * stride_k, cos, sin, num_kv_heads, HALF, HALF_PAD, BLOCK_HK)


def _check_heads(name: str, t: torch.Tensor, tokens: int, head_size: int) -> int:
    if t.dim() != 2 or t.shape[0] != tokens or t.shape[1] % head_size != 0:
        raise ValueError(f"{name} must be [{tokens}, heads*{head_size}], got {tuple(t.shape)}")
    if t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    return t.shape[1] // head_size


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    """Triton rotary embedding: rotates query [T, Hq*D] and key [T, Hk*D] in place."""
    if head_size % 2 != 0:
        raise ValueError(f"head_size must be even, got {head_size}")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be 1-D int32/int64, got {positions.dtype} {tuple(positions.shape)}")
    tokens = positions.shape[0]
    num_q_heads = _check_heads("query", query, tokens, head_size)
    num_kv_heads = _check_heads("key", key, tokens, head_size)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_size:
        raise ValueError(
            f"cos_sin_cache must be [max_position, {head_size}] (rotary_dim == head_size), "
            f"got {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be contiguous in its last dim")
    devices = {t.device for t in (positions, query, key, cos_sin_cache)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    if tokens == 0:
        return
    half = head_size // 2
    _rotary_kernel[(tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), key.stride(0), cos_sin_cache.stride(0), num_q_heads, num_kv_heads,
        HALF=half, HALF_PAD=next_power_of_2(half),
        BLOCK_HQ=next_power_of_2(num_q_heads), BLOCK_HK=next_power_of_2(num_kv_heads),
        num_warps=4,
    )
