"""FP8 E4M3 linear layers: weights quantized per output channel, symmetric, at load time.

``quantize_fp8`` turns a weight [N, K] into FP8 E4M3 values and one float32 scale per output
channel (``w ~= q * scale[:, None]``, the channel's largest magnitude mapped to 448, E4M3's
largest finite value). Two products use them:

- ``fp8_linear_scaled`` (W8A8): each row of the activations quantized to FP8 on the fly with
  its own scale (dynamic per-token), the product by ``torch._scaled_mm`` with both scales
  applied to its float32 sums: FP8 tensor cores on CUDA GPUs of compute capability 8.9+ (Ada,
  Hopper), bfloat16 activations, dimensions multiples of 16 (``scaled_mm_supported``).
- ``fp8_linear_ref`` (W8A16): the weight converted to the activations' dtype (exact: E4M3's
  3 mantissa bits and its range fit bfloat16, float16 and float32), multiplied, the product
  scaled per output channel. Everywhere else: older GPUs and the CPU, where oneDNN has no FP8
  product of its own (``torch._scaled_mm`` on the CPU converts and runs as slowly as this).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn  # the one FP8 type: weights and the KV cache
FP8_MAX = 448.0


def fp8_capable(device: torch.device) -> bool:
    """Whether ``device`` has FP8 E4M3: every CPU; CUDA GPUs of compute capability 8.9+ (Triton
    has no E4M3 below, and FP8 tensor cores start there). Asked once per GPU."""
    return device.type != "cuda" or _cuda_fp8(device.index or 0)


@functools.cache
def _cuda_fp8(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (float8_e4m3fn [N, K], float32 scale [N]); a row of
    zeros gets scale 1 (its values stay 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).to(FP8), scale


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """Weight-only FP8: x [..., K] @ q^T, scaled per output channel (+ bias), in x's dtype."""
    y = F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scale [M, 1]), each row's largest magnitude
    mapped to 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(FP8_MAX)
    return (xf / scale).to(FP8), scale


def scaled_mm_supported(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether ``fp8_linear_scaled`` runs here: CUDA with FP8 tensor cores, bfloat16
    activations, both dimensions of the weight multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and q.shape[0] % 16 == 0
            and q.shape[1] % 16 == 0 and fp8_capable(x.device))


def fp8_linear_scaled(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8: x [..., K] quantized per row, @ q^T by ``torch._scaled_mm`` with the row and
    channel scales (+ bias) -> [..., N] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, row_scale = quantize_rows_fp8(x.reshape(-1, k))
    y = torch._scaled_mm(xq, q.t(), scale_a=row_scale, scale_b=scale.float().view(1, -1),
                         bias=bias, out_dtype=x.dtype)
    return y.view(*lead, q.shape[0])
