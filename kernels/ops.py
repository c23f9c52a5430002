"""The kernel entry points the engine's layers call, with a backend switch.

Backends: "auto" (default) runs the Triton kernels on CUDA tensors and, on CPU tensors, the C
kernels of ``cpu_kernels`` (when a compiler built them and they take the tensors given), else the
pure-torch references; "triton" forces the Triton kernels (on the CPU only under ``TRITON_INTERPRET=1``);
"reference" forces the references. Importing this module does not require Triton.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kernels import activation as _act
from kernels import cpu_kernels as _cpu
from kernels import fp8_linear as _fp8
from kernels import fused_moe as _moe
from kernels import int8_gemm as _int8
from kernels import kv_cache as _kv
from kernels import paged_attention as _attn
from kernels import quant_linear as _quant
from kernels import rms_norm as _norm
from kernels import rotary as _rope
from kernels._triton import HAS_TRITON

BACKENDS = ("auto", "triton", "reference")
_backend = "auto"


def set_backend(name: str) -> None:
    """Select the kernel backend: one of "auto", "triton", "reference"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Use backend `name` inside the block, then restore the previous one."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _use_cpu(t: torch.Tensor) -> bool:
    return _backend == "auto" and t.device.type == "cpu"


def _use_triton(t: torch.Tensor) -> bool:
    if _backend == "triton":
        return True
    return _backend == "auto" and t.is_cuda and HAS_TRITON


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


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only int8: x [..., K] @ (q [N, K] * scale [N])^T (+ bias), in x's dtype. (On the
    CPU the layers run ``quant_linear.int8_linear`` on prepacked weights instead.)"""
    if _use_triton(x):
        return _int8.int8_linear_triton(x, q, scale, bias)
    return _quant.int8_linear_ref(x, q, scale, bias)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """FP8 E4M3 weights: x [..., K] @ (q [N, K] * scale [N])^T (+ bias), in x's dtype. W8A8
    through ``torch._scaled_mm`` where the GPU has FP8 tensor cores (bfloat16 activations), else
    weight-only: the Triton W8A16 kernel on CUDA (8.9+: Triton has no E4M3 for older GPUs),
    the reference elsewhere."""
    if _use_triton(x) and _fp8.fp8_capable(x.device):
        if _backend == "auto" and _fp8.scaled_mm_supported(x, q):
            return _fp8.fp8_linear_scaled(x, q, scale, bias)
        return _int8.int8_linear_triton(x, q, scale, bias)
    return _fp8.fp8_linear_ref(x, q, scale, bias)


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


def can_mask_logits(logits: torch.Tensor) -> bool:
    """Whether ``mask_logits`` takes these logits (the C kernel: CPU, float32 or bfloat16)."""
    return _use_cpu(logits) and _cpu.supports_mask(logits)


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Grammar masks in place: ``logits[r, t] = -inf`` where bit t of ``bitmask[r]`` (an int32
    token bitmask, 32 tokens a word) is 0, for r in ``rows`` (``can_mask_logits`` first)."""
    _cpu.mask_logits(logits, bitmask, rows)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (int64 [rows]; the first of equal maxima):
    ``logits.max(dim=-1).indices``, by the C kernel on CPU rows it takes (torch's reduction
    runs at a fifth of the memory's speed on a float32 vocabulary-wide row)."""
    if not (_use_cpu(logits) and _cpu.supports_mask(logits)):
        return logits.max(dim=-1).indices
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _cpu.call("argmax_rows_cpu", out.data_ptr(), logits.data_ptr(), logits.shape[0],
              logits.shape[1], logits.stride(0), _cpu.DTYPES[logits.dtype], torch.get_num_threads())
    return out


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [rows, vocab] (float32, each row a distribution up to its total),
    the smallest probability its top-p nucleus keeps (tokens from the most likely down, each
    kept while the mass before it is below ``top_p`` [rows] times the total): every token with
    probability >= it is in the nucleus. On CPU rows the C kernel (no sort of the vocabulary);
    elsewhere a sort."""
    if _use_cpu(probs) and probs.dtype == torch.float32 and _cpu.supports_mask(probs):
        tau = torch.empty(probs.shape[0], dtype=torch.float32)
        limits = top_p.to(torch.float32).contiguous()
        _cpu.call("top_p_threshold_cpu", tau.data_ptr(), probs.data_ptr(), probs.shape[0],
                  probs.shape[1], probs.stride(0), limits.data_ptr(), torch.get_num_threads())
        return tau
    return top_p_threshold_ref(probs, top_p)


def top_p_threshold_ref(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    ranked = probs.sort(dim=-1, descending=True).values
    before = ranked.double().cumsum(dim=-1) - ranked.double()
    want = top_p.double() * probs.double().sum(dim=-1)
    kept = (before < want.unsqueeze(1)).sum(dim=-1).clamp(min=1)
    return ranked.gather(1, (kept - 1).unsqueeze(1)).squeeze(1)


__all__ = [
    "BACKENDS",
    "backend",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "get_backend",
    "greedy_tokens",
    "can_mask_logits",
    "int8_linear",
    "mask_logits",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "set_backend",
    "silu_and_mul",
    "store_kv_cache",
    "top_p_threshold",
    "top_p_threshold_ref",
]
