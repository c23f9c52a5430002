"""How a layer with a [out, in] weight multiplies: shared by the linear layers and the LM head.

A layer keeps its weight in one of five forms, chosen after loading (``prepack``): prepacked
int8 for the C kernel (``int8``, with its scales; FP8 weights are requantized to int8 for it,
the CPU having no FP8 product), int8 with ``weight_scale`` (the Triton W8A16 kernel
on CUDA, else the weight-only reference), FP8 E4M3 with ``weight_scale`` (``ops.fp8_linear``),
prepacked in its dtype for oneDNN (``packed``), or plain (``F.linear``). ``matmul`` runs
whichever it holds.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import cpu_gemm, ops, quant_linear
from kernels.quant_linear import Int8Packed


class MatmulWeights(Protocol):
    packed: cpu_gemm.Packed | None
    int8: Int8Packed | None

    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def weight_scale(self) -> torch.Tensor | None: ...  # per output channel for int8 weights


def prepack(layer: MatmulWeights, keep_plain: bool = False) -> None:
    """After loading, on CPUs that support it: int8 weights in the C kernel's layout with their
    scales, others in oneDNN's layout in their dtype; the plain copy is released unless
    ``keep_plain`` (a weight the embedding shares)."""
    if layer.weight_scale is not None:
        if layer.int8 is None and quant_linear.cpu_supported(layer.weight):
            q, scale = layer.weight, layer.weight_scale
            if q.dtype == torch.float8_e4m3fn:  # the CPU has no FP8 product: requantized
                q, scale = quant_linear.quantize_int8(q.float() * scale[:, None])
            layer.int8 = quant_linear.pack_int8(q, scale)
            if not keep_plain:
                layer.weight.data = layer.weight.data.new_empty(0)
    elif layer.packed is None:
        layer.packed = cpu_gemm.take_packed(layer.weight, keep_plain=keep_plain)


def matmul(layer: MatmulWeights, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ the layer's weight^T (+ bias) -> [..., out] in x's dtype."""
    if layer.int8 is not None:
        return quant_linear.int8_linear(x, layer.int8, bias)
    if layer.weight_scale is not None:  # Triton on CUDA, else the reference
        if layer.weight.dtype == torch.float8_e4m3fn:
            return ops.fp8_linear(x, layer.weight, layer.weight_scale, bias)
        return ops.int8_linear(x, layer.weight, layer.weight_scale, bias)
    if layer.packed is not None:
        return cpu_gemm.packed_linear(x, layer.packed, bias)
    return F.linear(x, layer.weight, bias)
