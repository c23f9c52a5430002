"""The linear layers' products, behind ``kernels.ops``: which form a layer keeps its [out, in]
weight in, and which kernel multiplies by it.

A layer keeps its weight in one of five forms, chosen after loading (``prepack``): prepacked
int8 for the C kernel (``int8``, with its scales; FP8 weights are requantized to int8 for it,
the CPU having no FP8 product: ``quant_linear.py``), int8 with ``weight_scale`` (the Triton
W8A16 kernel on CUDA, else the weight-only reference), FP8 E4M3 with ``weight_scale``
(``fp8_linear``), prepacked in its dtype for the C dense kernel or oneDNN (``packed``,
``cpu_gemm.py``), or plain (``F.linear``). ``matmul`` runs whichever it holds.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import cpu_gemm
from kernels import fp8_linear as _fp8
from kernels import int8_gemm as _int8
from kernels import quant_linear as _quant
from kernels.settings import current as _settings
from kernels.settings import use_triton as _use_triton


class LinearWeights(Protocol):
    """What a layer holding a linear weight shows ``prepack`` and ``matmul``."""

    packed: cpu_gemm.Packed | None  # the weight prepacked for the CPU, or None
    int8: _quant.Int8Packed | None  # the int8 weight packed for the C kernel, or None

    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def weight_scale(self) -> torch.Tensor | None: ...  # per output channel for int8/FP8 weights


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
        if _settings().backend == "auto" and _fp8.scaled_mm_supported(x, q):
            return _fp8.fp8_linear_scaled(x, q, scale, bias)
        return _int8.int8_linear_triton(x, q, scale, bias)
    return _fp8.fp8_linear_ref(x, q, scale, bias)


def prepack(layer: LinearWeights, keep_plain: bool = False) -> None:
    """After loading, on CPUs that support it: int8 weights in the C kernel's layout with their
    scales, others in oneDNN's layout in their dtype; the plain copy is released unless
    ``keep_plain`` (a weight the embedding shares)."""
    if layer.weight_scale is not None:
        if layer.int8 is None and _quant.cpu_supported(layer.weight):
            q, scale = layer.weight, layer.weight_scale
            if q.dtype == torch.float8_e4m3fn:  # the CPU has no FP8 product: requantized
                q, scale = _quant.quantize_int8(q.float() * scale[:, None])
            layer.int8 = _quant.pack_int8(q, scale)
            if not keep_plain:
                layer.weight.data = layer.weight.data.new_empty(0)
    elif layer.packed is None:
        layer.packed = cpu_gemm.take_packed(layer.weight, keep_plain=keep_plain)


def matmul(layer: LinearWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ the layer's weight^T (+ bias) -> [..., out] in x's dtype."""
    if layer.int8 is not None:
        return _quant.int8_linear(x, layer.int8, bias)
    if layer.weight_scale is not None:  # Triton on CUDA, else the reference
        if layer.weight.dtype == torch.float8_e4m3fn:
            return fp8_linear(x, layer.weight, layer.weight_scale, bias)
        return int8_linear(x, layer.weight, layer.weight_scale, bias)
    if layer.packed is not None:
        return cpu_gemm.packed_linear(x, layer.packed, bias)
    return F.linear(x, layer.weight, bias)
