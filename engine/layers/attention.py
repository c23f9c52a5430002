"""Paged attention layer: stores this step's K/V into the cache, then attends over it; and
the checkpoint's fp8 KV-cache scales, read into it."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from engine.layers.context import get_context
from engine.loader import Loaded, ShardId, as_tensor, set_weight_loader
from kernels import ops

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    """``sliding_window`` (None or 0: global): a query sees only its last that many positions
    (itself included); ``softcap`` (None or 0: off): scores capped to c * tanh(score / c)."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None, softcap: float | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window, self.softcap = sliding_window or 0, softcap or 0.0
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
                                  ctx.max_query_len, ctx.max_seq_len, self.sliding_window,
                                  self.softcap)
        if self.v_scale != 1.0:
            out = out * self.v_scale
        return out.view(-1, self.num_heads * self.head_dim)


def _scalar_loader(param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
    value = as_tensor(loaded)
    if value.numel() != 1:
        raise ValueError(f"expected one per-tensor scale, checkpoint gives {tuple(value.shape)}")
    param.data.copy_(value.reshape(1))


def expect_kv_scales(model: nn.Module) -> None:
    """Before loading a checkpoint with fp8 KV scales: every module holding an ``Attention`` as
    ``attn`` (the models' ``self_attn``) takes ``k_scale`` and ``v_scale``, the names
    compressed-tensors writes."""
    for m in model.modules():
        if isinstance(getattr(m, "attn", None), Attention):
            for name in ("k_scale", "v_scale"):
                param = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
                set_weight_loader(param, _scalar_loader)
                m.register_parameter(name, param)


def finish_kv_scales(model: nn.Module, fp8_cache: bool) -> None:
    """After loading: check each scale (finite, positive) and hand it to the layer's
    ``Attention`` when the cache is fp8; an unquantized cache does not use them (logged)."""
    for name, m in model.named_modules():
        if isinstance(getattr(m, "attn", None), Attention) and hasattr(m, "k_scale"):
            k, v = float(m.k_scale), float(m.v_scale)
            if not all(math.isfinite(s) and s > 0 for s in (k, v)):
                raise ValueError(f"{name}: KV-cache scales must be finite and positive, "
                                 f"got k_scale {k}, v_scale {v}")
            if fp8_cache:
                m.attn.k_scale, m.attn.v_scale = k, v
            del m.k_scale, m.v_scale
    if not fp8_cache:
        logger.info("the checkpoint's fp8 KV-cache scales are unused: kv_cache_dtype is auto")
