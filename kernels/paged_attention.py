"""Paged attention over the block table for a mixed batch of prefill chunks and decode tokens.

Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1], its LAST q_len positions of a
context of seq_lens[b] tokens whose keys and values (the new ones included) are already in the
paged cache. Query token i of it sits at position seq_len - q_len + i and attends causally to
positions 0..that position. GQA: query head h reads kv head h // (Hq // Hk).
"""

from __future__ import annotations

import torch

from kernels._triton import interpreting, next_power_of_2, tl, triton
from kernels.attention_tile import TileLaunchArgs, attend_range, load_rows
from kernels.paged_attention_ref import gather_kv_ref, paged_attention_ref

__all__ = ["gather_kv_ref", "paged_attention_ref", "paged_attention_triton"]


LOG2E = 1.4426950408889634


@triton.jit
def find_seq(
    query_start_loc_ptr,  # [B+1] cumulative query lengths
    q_block,  # program's global query-block index
    num_seqs,  # B
    BLOCK_Q: tl.constexpr,  # query tokens per query block
):
    """Largest b with query_start_loc[b] // BLOCK_Q + b <= q_block (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D] strides (stride_ot, stride_oh, 1)
    q_ptr,  # [T, Hq, D] strides (stride_qt, stride_qh, 1)
    k_cache_ptr,  # [num_blocks, block_size, Hk, D] strides (stride_cb, stride_co, stride_ch, 1)
    v_cache_ptr,  # [num_blocks, block_size, Hk, D] same strides as k_cache
    block_tables_ptr,  # [B, max_blocks_per_seq] int32, row stride stride_bt
    seq_lens_ptr,  # [B] context length including the new query tokens
    query_start_loc_ptr,  # [B+1] cumulative query lengths
    qk_scale,  # softmax scale * log2(e)
    window, softcap,  # sliding window in keys (1 << 30: none); soft cap * log2(e) if SOFTCAP
    num_seqs, head_size,
    stride_ot, stride_oh, stride_qt, stride_qh,
    stride_cb, stride_co, stride_ch, stride_bt,
    GROUP: tl.constexpr,  # Hq // Hk query heads per kv head
    BLOCK_M: tl.constexpr,  # rows per program = BLOCK_Q tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP
    TILE_N: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DECODE: tl.constexpr,  # one query token per sequence: program i is sequence i, no search
    SOFTCAP: tl.constexpr,
):
    q_block, kv_head = tl.program_id(0), tl.program_id(1)
    seq = q_block if DECODE else find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = 0 if DECODE else q_block - (q_start // BLOCK_Q + seq)  # query block in the seq
    if local * BLOCK_Q >= q_len:  # slack program past this sequence's query blocks
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # tokens cached before this chunk
    rows = tl.arange(0, BLOCK_M)
    q_tok = local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_tok < q_len)
    token = (q_start + q_tok).to(tl.int64)
    q = load_rows(q_ptr, token * stride_qt + head * stride_qh, row_valid, head_size, D_PAD,
                  FP32_DOT)
    kv_end = tl.minimum(context + (local + 1) * BLOCK_Q, seq_len)
    kv_start = tl.maximum(context + local * BLOCK_Q - window + 1, 0)  # the first row's window
    acc, m_i, l_i = attend_range(
        q, context + q_tok, row_valid, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head.to(tl.int64) * stride_ch,
        kv_start, kv_end, qk_scale, window, softcap, stride_cb, stride_co, head_size,
        BLOCK_M, TILE_N, D_PAD, BLOCK_SIZE, FP32_DOT, SOFTCAP,
    )
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    dims = tl.arange(0, D_PAD)
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    mask = row_valid[:, None] & (dims[None, :] < head_size)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_attention_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor) -> None:
    if query.dim() != 3 or query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"query must be [T, Hq, D] fp16/bf16/fp32, got {query.dtype} {tuple(query.shape)}")
    _, num_q_heads, head_size = query.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != head_size:
        raise ValueError(f"k_cache must be [num_blocks, block_size, Hk, {head_size}], got {tuple(k_cache.shape)}")
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hk={num_kv_heads}")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if head_size > 256:
        raise ValueError(f"head_size must be <= 256, got {head_size}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache must have k_cache's shape and strides")
    if k_cache.dtype not in (query.dtype, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype}/{v_cache.dtype} must be query's {query.dtype} or fp8 e4m3")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    num_seqs = block_tables.shape[0]
    index_args = (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1), ("query_start_loc", query_start_loc, 1))
    for name, t, dims in index_args:
        if t.dim() != dims or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be {dims}-D int32/int64, got {t.dtype} {tuple(t.shape)}")
    if seq_lens.shape[0] != num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"seq_lens must be [{num_seqs}] and query_start_loc [{num_seqs + 1}]")
    if len({t.device for t in (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)}) != 1:
        raise ValueError("all paged_attention tensors must be on one device")


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    split_kv: bool | None = None,
    partition_size: int | None = None,
    sliding_window: int | None = 0,
    softcap: float | None = 0.0,
) -> torch.Tensor:
    """Triton paged attention: query [T, Hq, D] -> [T, Hq, D] in query's dtype.

    One launch covers the whole mixed batch. split_kv=None lets the launcher pick the split-KV
    (flash-decoding) path for decode-only batches with long contexts and few sequences; True/False
    force it (True needs max_query_len == 1). max_seq_len only sizes the split-KV grid.
    ``sliding_window`` and ``softcap``: as in ``paged_attention_ref`` (0 or None: off).
    """
    from kernels.paged_attention_split import launch_split, split_pays

    _check_attention_args(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    tokens, num_q_heads, head_size = query.shape
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    decode_only = max_query_len == 1 and tokens == num_seqs
    if split_kv is None:
        split_kv = decode_only and split_pays(query.device, num_seqs, num_kv_heads, max_seq_len)
    elif split_kv and not decode_only:
        raise ValueError("split_kv needs a decode-only batch (max_query_len == 1, T == B)")
    out = torch.zeros_like(query, memory_format=torch.contiguous_format)
    if tokens == 0 or num_seqs == 0:
        return out
    common = _common_launch_args(query, k_cache, scale, sliding_window or 0, softcap or 0.0)
    if split_kv:
        launch_split(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                     max_seq_len, partition_size, common)
        return out
    _launch_mixed(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                  max_query_len, common)
    return out


def _launch_mixed(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int,
                  common: TileLaunchArgs) -> None:
    """One pass over a mixed batch: a program per block of query rows (decode: per sequence)."""
    tokens, num_q_heads, head_size = query.shape
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_m = max(16 if max_query_len == 1 else 64, next_power_of_2(group))
    block_q = block_m // group
    decode = max_query_len == 1 and tokens == num_seqs
    grid = (num_seqs if decode else tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        common["qk_scale"], common["window"], common["softcap"], num_seqs, head_size,
        out.stride(0), out.stride(1), query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=common["TILE_N"],
        D_PAD=common["D_PAD"], BLOCK_SIZE=k_cache.shape[1], FP32_DOT=common["FP32_DOT"],
        DECODE=decode, SOFTCAP=common["SOFTCAP"], num_warps=4 if block_m <= 16 else 8 if head_size > 128 else 4,
    )


def _common_launch_args(query: torch.Tensor, k_cache: torch.Tensor, scale: float, window: int,
                        softcap: float) -> TileLaunchArgs:
    if window < 0 or softcap < 0:
        raise ValueError(f"sliding_window and softcap must be >= 0, got {window}, {softcap}")
    # The interpreter computes bf16 arithmetic wrongly: there everything is upcast to fp32.
    return {
        "qk_scale": scale * LOG2E,
        "window": window if window > 0 else 1 << 30,
        "softcap": softcap * LOG2E if softcap > 0 else 1.0,
        "SOFTCAP": softcap > 0,
        "TILE_N": 32,
        "D_PAD": next_power_of_2(query.shape[2]),
        "FP32_DOT": query.dtype == torch.float32 or interpreting(),
    }
