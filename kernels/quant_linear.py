"""INT8 linear layers: weights quantized per output channel, symmetric, at load time.

``quantize_int8`` turns a weight [N, K] into int8 values and one float32 scale per output
channel (``w ~= q * scale[:, None]``, ``|q| <= 127``). Two products use them:

- ``int8_linear_ref`` (any device): weight-only (W8A16): the int8 weight is converted to the
  activations' dtype (integers up to 127 are exact in bfloat16 and float16), multiplied, and the
  product scaled per output channel. The reference, and the path on GPUs until a fused kernel
  lands.
- ``int8_linear`` (CPU, oneDNN): the product itself in int8. Each row of the activations is
  quantized on the fly to uint8 with its own scale (dynamic per-token quantization, zero point
  128), oneDNN multiplies the uint8 rows by the prepacked int8 weight (VNNI dot products where
  the CPU has them), and the int32 sums come back scaled by the weight's channel scales and the
  row's scale. This is how vLLM's CPU backend runs INT8 models. Measured against the prepacked
  bfloat16 product on the 0.5B model's shapes (2-core AMD Zen 4, AVX512-VNNI): 1.5-2.6x faster
  for the MLP's wide products at 1-256 rows, even for the narrow q/k/v product; capped to AVX2
  (no VNNI) against float32 prepacked: 1.2-2.9x faster for the wide ones. ATen's weight-only
  ``_weight_int8pack_mm`` was measured too: 2.5x faster than bfloat16 at one row, 2-3x slower
  from 8 rows on, and 10-40x slower with float32 activations, so it is not used.

Rows are padded to ``cpu_gemm.padded_rows`` buckets as the prepacked float products are: oneDNN
builds a kernel per row count.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_kernels, settings

_ZERO_POINT = 128  # activations: uint8 = round(x / row_scale) + 128, so |x| maps to 1..255


class Int8Packed(NamedTuple):
    """A weight prepacked for oneDNN's int8 product, with what the product needs beside it."""

    weight: torch.Tensor  # opaque oneDNN int8 tensor, shaped [K, N]
    scale: torch.Tensor  # [N] float32, per output channel
    zero_points: torch.Tensor  # [N] int64 zeros (the weight is symmetric)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (int8 [N, K], float32 scale [N]); a row of zeros
    gets scale 1 (its values stay 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only int8: x [..., K] @ q^T, scaled per output channel (+ bias), in x's dtype."""
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


def cpu_supported(q: torch.Tensor) -> bool:
    """Whether oneDNN's int8 product takes this weight: a CPU tensor, oneDNN present, and the
    ``packed_gemm`` switch on (off, the weight-only reference runs)."""
    return (settings.current().packed_gemm and q.device.type == "cpu" and q.dim() == 2
            and torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]  # unannotated in torch


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Packed:
    """int8 [N, K] and its scales -> oneDNN's prepacked form for ``int8_linear``."""
    packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), [64, q.shape[1]])
    zeros = torch.zeros(q.shape[0], dtype=torch.int64)
    return Int8Packed(packed, scale.float().contiguous(), zeros)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (uint8 [M, K] with zero point 128, float32 scale [M, 1]) per row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-10).div_(127.0)
    xq = torch.round(x / scale).add_(_ZERO_POINT).to(torch.uint8)
    return xq, scale


def int8_linear(x: torch.Tensor, w: Int8Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) @ w^T (+ bias) -> [..., N] in x's dtype, with the
    activations quantized per row (see the module's docstring)."""
    if x.dim() != 2:
        return int8_linear(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], -1)
    m = x.shape[0]
    mp = cpu_gemm.padded_rows(m)
    if cpu_kernels.supports_quantize_rows(x):  # one pass in C, padding rows included
        xq, row_scale = cpu_kernels.quantize_rows_u8(x, mp)
    else:
        xq, row_scale = quantize_rows(x)
        if mp != m:  # rows are independent: padding rows hold the zero point (x = 0)
            padded = xq.new_full((mp, xq.shape[1]), _ZERO_POINT)
            padded[:m] = xq
            xq = padded
    y = _product(xq, w, x.dtype)
    if mp != m:
        y = y[:m]
    y.mul_(row_scale.to(x.dtype))
    return y if bias is None else y.add_(bias)


def _product(xq: torch.Tensor, w: Int8Packed, dtype: torch.dtype) -> torch.Tensor:
    y: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
        xq, 1.0, _ZERO_POINT, w.weight, w.scale, w.zero_points, None, 1.0, 0, dtype, "none", [], "")
    return y


def warm_up(weights: list[Int8Packed], dtype: torch.dtype, max_rows: int) -> int:
    """Build oneDNN's int8 kernel of every row bucket up to ``max_rows`` for each distinct
    weight shape; returns how many products ran."""
    seen: set[tuple[int, int]] = set()
    runs = 0
    for w in weights:
        k, n = w.weight.shape
        if (n, k) in seen:
            continue
        seen.add((n, k))
        m = 8
        while m <= cpu_gemm.padded_rows(max_rows):
            _product(torch.full((m, k), _ZERO_POINT, dtype=torch.uint8), w, dtype)
            runs += 1
            m += 8 if m < 256 else 64
    return runs
