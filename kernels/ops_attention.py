"""The attention entry points behind ``kernels.ops``: the KV-cache store and paged attention,
each to the Triton kernel on CUDA tensors, the C kernel on CPU tensors it takes, else the torch
reference (``kernels.settings`` says which backend runs)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import cpu_launchers as _cpu
from kernels import kv_cache as _kv
from kernels import paged_attention as _attn
from kernels.settings import use_cpu as _use_cpu
from kernels.settings import use_triton as _use_triton


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hk, D] into the paged caches at slot_mapping [T]; slot -1 is skipped.
    Caches of fp8 E4M3 store key / k_scale and value / v_scale (``kv_cache.py``)."""
    args = (key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if _use_triton(key):
        _kv.store_kv_cache_triton(*args)
    elif _use_cpu(key) and _cpu.supports_store(key, value, k_cache, v_cache, slot_mapping):
        _cpu.store_kv_cache(*args)
    else:
        _kv.store_kv_cache_ref(*args)


def paged_attention(
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
    """Causal GQA attention of query [T, Hq, D] over the paged cache -> [T, Hq, D]. The caches
    hold query's dtype or fp8 E4M3, read upcast (their scales are the caller's: the key scale
    folded into ``scale``, the value scale applied to the output). ``sliding_window`` > 0: each
    query sees its last that many positions; ``softcap`` > 0: scores capped to
    softcap * tanh(score / softcap) (``paged_attention_ref``)."""
    fn: Callable[..., torch.Tensor]
    if _use_triton(query):
        fn = _attn.paged_attention_triton
    elif _use_cpu(query) and _cpu.supports_attention(query, k_cache, v_cache, block_tables,
                                                     seq_lens, query_start_loc):
        return _cpu.paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                    query_start_loc, scale, sliding_window, softcap)
    else:
        fn = _attn.paged_attention_ref
    return fn(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale, max_query_len, max_seq_len, sliding_window=sliding_window, softcap=softcap,
    )
