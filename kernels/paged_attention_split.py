"""Split-KV (flash-decoding) paged attention for decode-only batches with long contexts.

With few sequences the one-program-per-(sequence, kv head) grid leaves most of the GPU idle. Each
sequence's context is cut into ``num_splits`` chunks, each chunk its own length's share (a
multiple of the key tile) computed in the kernel from the sequence's real length; each
(sequence, kv head, split) program writes an unnormalised partial output with its running max and
sum, and a reduce kernel merges the splits of each (sequence, query head). The split count is a
runtime value (as is every length), so one compiled variant per model and dtype serves every
context length: no compile under traffic as contexts grow, and under CUDA graphs (split count
fixed by ``max_model_len``) a short context still spreads over all splits.
"""

from __future__ import annotations

import functools

import torch

from kernels._triton import next_power_of_2, tl, triton
from kernels.attention_tile import TileLaunchArgs, attend_range, load_rows

DEFAULT_PARTITION = 512
MAX_SPLITS = 64


@triton.jit(do_not_specialize=["num_splits"])
def _split_kernel(
    part_acc_ptr,  # [B, Hq, num_splits, D_PAD] float32, contiguous: unnormalised partial outputs
    part_ml_ptr,  # [B, Hq, num_splits, 2] float32, contiguous: (max in log2 domain, sum of exp)
    q_ptr,  # [T, Hq, D] strides (stride_qt, stride_qh, 1); T == B, one token per sequence
    k_cache_ptr,  # [num_blocks, block_size, Hk, D] strides (stride_cb, stride_co, stride_ch, 1)
    v_cache_ptr,  # [num_blocks, block_size, Hk, D] same strides as k_cache
    block_tables_ptr,  # [B, max_blocks_per_seq] int32, row stride stride_bt
    seq_lens_ptr,  # [B]
    query_start_loc_ptr,  # [B+1]
    qk_scale,  # softmax scale * log2(e)
    window, softcap,  # sliding window in keys (1 << 30: none); soft cap * log2(e) if SOFTCAP
    num_q_heads, head_size,
    num_splits,  # programs per (sequence, kv head) along the context
    stride_qt, stride_qh, stride_cb, stride_co, stride_ch, stride_bt,
    GROUP: tl.constexpr,  # Hq // Hk
    BLOCK_M: tl.constexpr,  # next power of two >= max(GROUP, 16)
    TILE_N: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - token
    rows = tl.arange(0, BLOCK_M)
    head = kv_head * GROUP + rows
    # No rows for a sequence without a query token (a scalar condition kept out of the block
    # mask: Triton 3.9's interpreter rejects a block mask and-ed with a scalar comparison).
    row_valid = rows < tl.where(q_len > 0, GROUP, 0)
    q = load_rows(q_ptr, token * stride_qt + head * stride_qh, row_valid, head_size, D_PAD,
                  FP32_DOT)
    first = tl.maximum(seq_len - window, 0)  # the window's first key
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), TILE_N) * TILE_N  # this split's share
    kv_start = first + split * chunk
    kv_end = tl.minimum(kv_start + chunk, seq_len)  # empty past the end: max -inf, sum 0
    acc, m_i, l_i = attend_range(
        q, tl.zeros([BLOCK_M], tl.int32) + seq_len - 1, row_valid, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq * stride_bt, kv_head.to(tl.int64) * stride_ch,
        kv_start, kv_end, qk_scale, window, softcap, stride_cb, stride_co, head_size,
        BLOCK_M, TILE_N, D_PAD, BLOCK_SIZE, FP32_DOT, SOFTCAP,
    )
    part = (seq * num_q_heads + head) * num_splits + split  # [BLOCK_M]
    keep = rows < GROUP
    dims = tl.arange(0, D_PAD)
    tl.store(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], acc, mask=keep[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=keep)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=keep)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr,  # [T, Hq, D] strides (stride_ot, stride_oh, 1)
    part_acc_ptr,  # [B, Hq, num_splits, D_PAD] float32
    part_ml_ptr,  # [B, Hq, num_splits, 2] float32
    query_start_loc_ptr,  # [B+1]
    num_q_heads,
    head_size,
    num_splits,
    stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr,  # a power of two >= every num_splits (MAX_SPLITS)
    D_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    if tl.load(query_start_loc_ptr + seq + 1) == token:  # sequence without a query token
        return
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    part = (seq * num_q_heads + head) * num_splits + splits
    in_split = splits < num_splits
    maxes = tl.load(part_ml_ptr + part * 2, mask=in_split, other=float("-inf"))
    sums = tl.load(part_ml_ptr + part * 2 + 1, mask=in_split, other=0.0)
    top = tl.max(maxes, axis=0)
    weight = tl.exp2(maxes - tl.where(top == float("-inf"), 0.0, top))  # empty splits -> 0
    denom = tl.sum(weight * sums, axis=0)
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + dims[None, :], mask=in_split[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_size)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter: behave like an H100/H200 so the heuristic is deterministic


def split_pays(device: torch.device, num_seqs: int, num_kv_heads: int, max_seq_len: int) -> bool:
    """Split when the plain grid would fill under half the SMs and the context spans partitions."""
    return max_seq_len >= 2 * DEFAULT_PARTITION and num_seqs * num_kv_heads < _sm_count(device) // 2


def launch_split(
    out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
    max_seq_len: int, partition: int | None, common: TileLaunchArgs,
) -> None:
    """Run the split and reduce kernels; arguments were checked by paged_attention_triton.
    The split count: ``max_seq_len`` over ``partition`` (default 512) keys, at most
    ``MAX_SPLITS``; each sequence's chunk is its own length over that count (in the kernel)."""
    num_seqs, num_q_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    tile = common["TILE_N"]
    partition = DEFAULT_PARTITION if partition is None else partition
    if partition % tile != 0:
        raise ValueError(f"partition_size must be a multiple of {tile}, got {partition}")
    num_splits = min(max(-(-max_seq_len // partition), 1), MAX_SPLITS)
    d_pad = common["D_PAD"]
    part_acc = torch.empty((num_seqs, num_q_heads, num_splits, d_pad), dtype=torch.float32, device=query.device)
    part_ml = torch.empty((num_seqs, num_q_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_acc, part_ml, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        common["qk_scale"], common["window"], common["softcap"], num_q_heads, head_size,
        num_splits,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, BLOCK_M=max(16, next_power_of_2(group)),
        TILE_N=tile, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1],
        FP32_DOT=common["FP32_DOT"], SOFTCAP=common["SOFTCAP"], num_warps=4,
    )
    _reduce_kernel[(num_seqs, num_q_heads)](
        out, part_acc, part_ml, query_start_loc, num_q_heads, head_size, num_splits,
        out.stride(0), out.stride(1),
        SPLITS_PAD=MAX_SPLITS, D_PAD=d_pad, num_warps=4,
    )
