"""The pure-torch paged attention: the CPU fallback and the Triton and C kernels' yardstick.

The contract of ``kernels.paged_attention``: sequence b owns query rows
query_start_loc[b]:query_start_loc[b+1], its last q_len positions of a context of seq_lens[b]
tokens already in the paged cache; the query at position p sees keys at positions <= p, and with
a sliding window W (> 0) only those > p - W (Hugging Face's ``sliding_window``: W keys, itself
included). A soft cap c (> 0) maps each scaled score s to c * tanh(s / c) before the softmax
(Gemma 2's ``attn_logit_softcapping``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv_ref(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """cache [N, block_size, Hk, D], block_tables [B, M] -> [B, num_tokens, Hk, D] (cache dtype)."""
    batch, block_size = block_tables.shape[0], cache.shape[1]
    num_blocks = min(-(-num_tokens // block_size), block_tables.shape[1])
    blocks = block_tables[:, :num_blocks].reshape(-1).long().clamp_min(0)
    if not cache.is_contiguous():  # index_select copies whole blocks only from a dense cache
        return cache[blocks.view(batch, num_blocks)].flatten(1, 2)[:, :num_tokens]
    gathered = cache.index_select(0, blocks)  # [B * nb, block_size, Hk, D]
    return gathered.view(batch, num_blocks * block_size, *cache.shape[2:])[:, :num_tokens]


def _compute_dtype(dtype: torch.dtype, softcap: float) -> torch.dtype:
    """bfloat16 stays bfloat16 (torch's CPU flash attention accumulates in float32 inside, and
    skipping the upcast halves the bytes moved); other dtypes, and soft-capped scores (no fused
    attention takes them), compute in float32."""
    return torch.bfloat16 if dtype == torch.bfloat16 and not softcap else torch.float32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
            scale: float, softcap: float) -> torch.Tensor:
    """softmax(scores where ``visible``, else -inf) @ v; q [..., M, D], k/v [..., L, D]."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
    # the cap in float64: in some processes torch's first float32 tanh of these scores came out
    # up to 5e-5 off in a few elements, the next call on the same tensor exact (one kernel test
    # run in five failed on it; the cause inside torch not found)
    scores = q @ k.transpose(-1, -2)
    scores = (torch.tanh(scores.double() * (scale / softcap)) * softcap).to(scores.dtype)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def _decode_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                max_seq_len: int, window: int, softcap: float) -> torch.Tensor:
    """One query token per sequence: query [B, Hq, D] -> [B, Hq, D], one batched call."""
    batch, num_q_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    dt = _compute_dtype(query.dtype, softcap)
    k = gather_kv_ref(k_cache, block_tables, max_seq_len).to(dt).transpose(1, 2)  # [B, Hk, L, D]
    v = gather_kv_ref(v_cache, block_tables, max_seq_len).to(dt).transpose(1, 2)
    q = query.to(dt).view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_size)
    key_pos = torch.arange(k.shape[2], device=query.device)
    visible = key_pos < seq_lens[:, None]  # [B, L]
    if window > 0:
        visible &= key_pos >= seq_lens[:, None] - window
    out = _attend(q, k, v, visible[:, None, None, :], scale, softcap)
    out = torch.where((seq_lens > 0)[:, None, None, None], out, 0.0)
    return out.reshape(batch, num_q_heads, head_size)


def _prefill_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_len: int, scale: float, window: int,
                 softcap: float) -> torch.Tensor:
    """One sequence's chunk: query [q_len, Hq, D] (its last q_len positions)."""
    q_len, num_q_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    dt = _compute_dtype(query.dtype, softcap)
    k = gather_kv_ref(k_cache, block_table[None], seq_len).to(dt).transpose(1, 2)  # [1, Hk, L, D]
    v = gather_kv_ref(v_cache, block_table[None], seq_len).to(dt).transpose(1, 2)
    if q_len == seq_len and window <= 0 and not softcap:  # plain causal attention, GQA-expanded
        q = query.to(dt).transpose(0, 1)[None]  # [1, Hq, q_len, D]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)
    # [q_len, Hk, G, D] -> [1, Hk, G * q_len, D]: each kv head serves its G query heads in one call
    # (4-D inputs take torch's fused CPU attention; 3-D ones fall back to the slow math path).
    q = query.to(dt).view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.reshape(1, num_kv_heads, group * q_len, head_size)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    visible = key_pos <= q_pos  # [q_len, L]
    if window > 0:
        visible &= key_pos > q_pos - window
    out = _attend(q, k, v, visible.repeat(group, 1), scale, softcap)
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
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D] in query's dtype (float32 inside; bfloat16 stays bfloat16
    unless soft-capped). ``sliding_window`` 0 (or None) and ``softcap`` 0.0 (or None): off.

    Decode sequences (q_len 1) share one padded gather and one masked attention call; prefill
    chunks are computed one sequence at a time. Rows of tokens outside every sequence are zero.
    """
    window, cap = sliding_window or 0, softcap or 0.0
    num_seqs = block_tables.shape[0]
    if max_query_len == 1 and query.shape[0] == num_seqs:  # decode-only: no host sync
        out = _decode_ref(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                          window, cap)
        return out.to(query.dtype)
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(num_seqs) if starts[b + 1] - starts[b] == 1]
    if decode:
        idx = torch.tensor(decode, device=query.device)
        rows = query_start_loc[idx].long()
        dec_max = max(lens[b] for b in decode)
        dec = _decode_ref(query[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale,
                          dec_max, window, cap)
        out[rows] = dec.to(query.dtype)
    for b in range(num_seqs):
        q_len = starts[b + 1] - starts[b]
        if q_len <= 1:
            continue
        chunk = query[starts[b] : starts[b + 1]]
        res = _prefill_ref(chunk, k_cache, v_cache, block_tables[b], lens[b], scale, window, cap)
        out[starts[b] : starts[b + 1]] = res.to(query.dtype)
    return out
