"""Paged attention layer: stores this step's K/V into the cache, then attends over it."""

from __future__ import annotations

import torch
from torch import nn

from engine.context import get_context
from kernels import ops


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        # An fp8 cache holds k / k_scale and v / v_scale (1.0 unless the checkpoint gives them):
        # the key scale joins the softmax scale, the value scale multiplies the output.
        self.k_scale, self.v_scale = 1.0, 1.0
        # Views into this layer's slice of the cache, bound by the model runner:
        # [num_blocks, block_size, num_kv_heads, head_dim] each.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None:
            raise RuntimeError("Attention: no KV cache bound (the model runner binds it)")
        ops.store_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping, self.k_scale, self.v_scale)
        out = ops.paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens,
                                  ctx.query_start_loc, self.scale * self.k_scale,
                                  ctx.max_query_len, ctx.max_seq_len)
        if self.v_scale != 1.0:
            out = out * self.v_scale
        return out.view(-1, self.num_heads * self.head_dim)
