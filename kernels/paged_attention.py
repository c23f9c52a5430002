"""Paged attention over the block table for a mixed batch of prefill chunks and decode tokens.

Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1], its LAST q_len positions of a
context of seq_lens[b] tokens whose keys and values (the new ones included) are already in the
paged cache. Query token i of it sits at position seq_len - q_len + i and attends causally to
positions 0..that position. GQA: query head h reads kv head h // (Hq // Hk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton  # noqa: F401  (kernel added next)


def gather_kv_ref(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache [N, block_size, Hk, D], block_tables [B, M] -> [B, num_tokens, Hk, D] (cache dtype)."""
    block_size = cache.shape[1]
    num_blocks = min(-(-num_tokens // block_size), block_tables.shape[1])
    blocks = block_tables[:, :num_blocks].long().clamp_min(0)
    return cache[blocks].flatten(1, 2)[:, :num_tokens]


def _decode_ref(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len):
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D] float32, one batched call."""
    batch, num_q_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    k = gather_kv_ref(k_cache, block_tables, max_seq_len).float().transpose(1, 2)  # [B, Hk, L, D]
    v = gather_kv_ref(v_cache, block_tables, max_seq_len).float().transpose(1, 2)
    q = query.float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_size)
    valid = torch.arange(k.shape[2], device=query.device) < seq_lens[:, None]  # [B, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    out = torch.where((seq_lens > 0)[:, None, None, None], out, 0.0)
    return out.reshape(batch, num_q_heads, head_size)


def _prefill_ref(query, k_cache, v_cache, block_table, seq_len, scale):
    """One sequence's chunk: query [q_len, Hq, D] (its last q_len positions) -> float32."""
    q_len, num_q_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k = gather_kv_ref(k_cache, block_table[None], seq_len)[0].float().transpose(0, 1)  # [Hk, L, D]
    v = gather_kv_ref(v_cache, block_table[None], seq_len)[0].float().transpose(0, 1)
    # [q_len, Hk, G, D] -> [Hk, G * q_len, D]: each kv head serves its G query heads in one call.
    q = query.float().view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * q_len, head_size)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    causal = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, L]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal.repeat(group, 1), scale=scale)
    out = out.view(num_kv_heads, group, q_len, head_size).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_q_heads, head_size)


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] in query's dtype (float32 inside).

    Decode sequences (q_len 1) share one padded gather and one masked attention call; prefill
    chunks are computed one sequence at a time. Rows of tokens outside every sequence are zero.
    """
    num_seqs = block_tables.shape[0]
    if max_query_len == 1 and query.shape[0] == num_seqs:  # decode-only: no host sync
        out = _decode_ref(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len)
        return out.to(query.dtype)
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(num_seqs) if starts[b + 1] - starts[b] == 1]
    if decode:
        idx = torch.tensor(decode, device=query.device)
        rows = query_start_loc[idx].long()
        dec_max = max(lens[b] for b in decode)
        dec = _decode_ref(query[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale, dec_max)
        out[rows] = dec.to(query.dtype)
    for b in range(num_seqs):
        q_len = starts[b + 1] - starts[b]
        if q_len <= 1:
            continue
        chunk = query[starts[b] : starts[b + 1]]
        res = _prefill_ref(chunk, k_cache, v_cache, block_tables[b], lens[b], scale)
        out[starts[b] : starts[b + 1]] = res.to(query.dtype)
    return out
