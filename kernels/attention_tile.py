"""The online-softmax inner loop shared by the paged attention kernels.

One program holds BLOCK_M query rows (query tokens x the GQA heads of one kv head) and walks the
context in tiles of TILE_N key positions, gathering each key's cache block from the block table,
so the tile size is independent of the cache's block_size. Scores live in the log2 domain
(qk_scale = softmax scale * log2(e)); everything accumulates in float32. A sliding window hides
keys at positions <= q_pos - window (the launchers pass a huge window when there is none), and a
soft cap c maps each scaled score s to c * tanh(s / c) (passed as c * log2(e), in the log2
domain, with the SOFTCAP flag).
"""

from __future__ import annotations

from typing import TypedDict

from kernels._triton import tl, triton


class TileLaunchArgs(TypedDict):
    """The launch arguments both attention kernels take for `attend_range`."""

    qk_scale: float  # softmax scale * log2(e)
    window: int  # sliding window in keys (1 << 30: none)
    softcap: float  # soft cap * log2(e) (read only when SOFTCAP)
    SOFTCAP: bool
    TILE_N: int
    D_PAD: int
    FP32_DOT: bool


@triton.jit
def load_rows(ptr, row_offs, row_valid, head_size, D_PAD: tl.constexpr, FP32: tl.constexpr):
    """[BLOCK_M, D_PAD] rows at ``ptr + row_offs`` (zeros past ``head_size`` and in rows that
    are not valid), upcast to float32 when ``FP32``."""
    dims = tl.arange(0, D_PAD)
    mask = row_valid[:, None] & (dims[None, :] < head_size)
    x = tl.load(ptr + row_offs[:, None] + dims[None, :], mask=mask, other=0.0)
    if FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _tanh(x):
    """tanh from one exp2 of -2|x| (no overflow; libdevice is not there under the interpreter)."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _scores(q, k, qk_scale, softcap, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """q k^T scaled into the log2 domain (and soft-capped), float32."""
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))  # an fp8 cache is upcast to q's type
    s = s * qk_scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, pos, in_range,
                  dims, dim_ok, stride_cb, stride_co, BLOCK_SIZE: tl.constexpr):
    """The keys and values at key positions ``pos`` (zeros where not ``in_range``), each
    gathered from its cache block through the block table."""
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    offs = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_co + kv_head_offset
    kv_ptrs = offs[:, None] + dims[None, :]
    kv_mask = in_range[:, None] & dim_ok
    k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def attend_range(
    q,  # [BLOCK_M, D_PAD] query rows (fp32 when FP32_DOT, else the query dtype)
    q_pos,  # [BLOCK_M] int position of each query row; key positions <= q_pos are visible
    row_valid,  # [BLOCK_M] bool, rows that are real (query token, head) pairs
    k_cache_ptr,  # [num_blocks, block_size, Hk, D] strides (stride_cb, stride_co, stride_ch, 1)
    v_cache_ptr,  # [num_blocks, block_size, Hk, D] same strides as k_cache
    block_table_ptr,  # [max_blocks_per_seq] int32 row of this sequence's block table
    kv_head_offset,  # int64 kv_head * stride_ch
    kv_start,  # first key position to visit
    kv_end,  # one past the last key position to visit
    qk_scale,  # softmax scale * log2(e)
    window,  # keys at positions <= q_pos - window are hidden (sliding window)
    softcap,  # soft cap * log2(e), read when SOFTCAP
    stride_cb,  # cache block stride (elements)
    stride_co,  # cache in-block token stride
    head_size,  # D
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,  # key positions per iteration (>= 16 for tl.dot)
    D_PAD: tl.constexpr,  # next power of two >= D; dims >= D are masked
    BLOCK_SIZE: tl.constexpr,  # cache block size (power of two)
    FP32_DOT: tl.constexpr,  # upcast K/V/P to fp32 and use IEEE fp32 dots
    SOFTCAP: tl.constexpr,  # cap the scores: softcap * tanh(s / softcap)
):
    dims = tl.arange(0, D_PAD)
    dim_ok = dims[None, :] < head_size
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(kv_start, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        in_range = pos < kv_end
        k, v = _load_kv_tile(k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head_offset, pos,
                             in_range, dims, dim_ok, stride_cb, stride_co, BLOCK_SIZE)
        s = _scores(q, k, qk_scale, softcap, FP32_DOT, SOFTCAP)
        visible = row_valid[:, None] & in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i
