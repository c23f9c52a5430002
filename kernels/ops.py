"""The engine's one door into ``kernels``: every computation the engine runs. Which backend runs
is said in one place, ``kernels.settings`` (``backend``: "auto" runs the Triton kernels on CUDA
tensors and, on CPU tensors, the C kernels of ``cpu_kernels`` where a compiler built them and
they take the tensors given, else the pure-torch references; "triton"; "reference"); the
switches and the machine's facts the engine reads are there too. Importing this module does not
require Triton.

| what | entry points | where |
|---|---|---|
| norms, activation, rotary, MoE | ``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding``, ``fused_moe`` | here |
| attention | ``store_kv_cache``, ``paged_attention`` | ``ops_attention.py`` |
| sampling | ``can_mask_logits``, ``mask_logits``, ``greedy_tokens``, ``top_p_threshold`` (``_ref``) | ``ops_sampling.py`` |
| linear layers | ``matmul`` and ``prepack`` of a ``LinearWeights`` layer; ``int8_linear``, ``fp8_linear`` | ``ops_linear.py`` |
| weight formats | ``quantize_int8``, ``quantize_fp8``; ``Packed``, ``DensePacked``, ``Int8Packed``; ``take_gated`` (the fused gate-up product), ``warm_up_packed`` | ``quant_linear.py``, ``fp8_linear.py``, ``cpu_gemm.py`` |
"""

from __future__ import annotations

import torch

from kernels import activation as _act
from kernels import cpu_launchers as _cpu
from kernels import fused_moe as _moe
from kernels import rms_norm as _norm
from kernels import rotary as _rope
from kernels.cpu_gemm import DensePacked, Packed, take_gated
from kernels.cpu_gemm import warm_up as warm_up_packed
from kernels.fp8_linear import quantize_fp8
from kernels.ops_attention import paged_attention, store_kv_cache
from kernels.ops_linear import LinearWeights, fp8_linear, int8_linear, matmul, prepack
from kernels.ops_sampling import (
    can_mask_logits,
    greedy_tokens,
    mask_logits,
    top_p_threshold,
    top_p_threshold_ref,
)
from kernels.quant_linear import Int8Packed, quantize_int8
from kernels.settings import use_cpu as _use_cpu
from kernels.settings import use_triton as _use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H] in x's dtype."""
    if _use_triton(x):
        return _norm.rms_norm_triton(x, weight, eps)
    if _use_cpu(x) and _cpu.supports_norm(x, weight):
        return _cpu.rms_norm(x, weight, eps)
    return _norm.rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual (in place); returns (rms_norm(residual) * weight, residual)."""
    if _use_triton(x):
        return _norm.fused_add_rms_norm_triton(x, residual, weight, eps)
    if _use_cpu(x) and _cpu.supports_norm(x, weight, residual):
        return _cpu.rms_norm(x, weight, eps, residual), residual
    return _norm.fused_add_rms_norm_ref(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> silu(x[:, :I]) * x[:, I:], [T, I]."""
    if _use_triton(x):
        return _act.silu_and_mul_triton(x)
    if _use_cpu(x) and _cpu.supports_silu_and_mul(x):
        return _cpu.silu_and_mul(x)
    return _act.silu_and_mul_ref(x)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
) -> None:
    """Rotate query [T, Hq*D] and key [T, Hk*D] in place by cos_sin_cache[positions]."""
    if _use_triton(query):
        _rope.rotary_embedding_triton(positions, query, key, cos_sin_cache, head_size)
    elif _use_cpu(query) and _cpu.supports_rotary(positions, query, key, cos_sin_cache, head_size):
        _cpu.rotary_embedding(positions, query, key, cos_sin_cache, head_size)
    else:
        _rope.rotary_embedding_ref(positions, query, key, cos_sin_cache, head_size)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Top-k experts' gated MLPs (w13 [E, 2I, H], w2 [E, H, I]) of x [T, H], weighted by
    topk_weights [T, K] and summed -> [T, H]: the Triton grouped GEMM on CUDA, grouped_mm on
    the CPU (``kernels/fused_moe.py``), else the per-expert reference."""
    if _use_triton(x):
        return _moe.fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    if _use_cpu(x) and _moe.grouped_mm_supported(x):
        return _moe.fused_moe_cpu(x, w13, w2, topk_weights, topk_ids)
    return _moe.fused_moe_ref(x, w13, w2, topk_weights, topk_ids)


__all__ = [
    "DensePacked",
    "Int8Packed",
    "LinearWeights",
    "Packed",
    "can_mask_logits",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "greedy_tokens",
    "int8_linear",
    "mask_logits",
    "matmul",
    "paged_attention",
    "prepack",
    "quantize_fp8",
    "quantize_int8",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
    "take_gated",
    "top_p_threshold",
    "top_p_threshold_ref",
    "warm_up_packed",
]
