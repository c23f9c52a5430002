"""INT8 linear layers: weights quantized per output channel, symmetric, at load time.

``quantize_int8`` turns a weight [N, K] into int8 values and one float32 scale per output
channel (``w ~= q * scale[:, None]``, ``|q| <= 127``). Two products use them:

- ``int8_linear_ref`` (any device): weight-only (W8A16): the int8 weight is converted to the
  activations' dtype (integers up to 127 are exact in bfloat16 and float16), multiplied, and the
  product scaled per output channel. The reference, and the path on CPUs without the C kernels.
- ``int8_linear`` (CPU, ``csrc/int8_linear_cpu.c``): the product itself in int8, on a weight
  packed once at load time (``pack_int8``: blocks of 16 output channels by groups of 4 inputs,
  one VNNI operand per 64 bytes). Each row of the activations is quantized on the fly to uint8
  with its own scale (dynamic per-token quantization, zero point 128), the products are summed
  exactly in int32 (VNNI dot products, or int16 multiply-adds without VNNI), and the sums are
  scaled by the row's and the channel's scales: ``int8_linear_dynamic_ref`` is the same
  arithmetic in torch, bit for bit. Rows never depend on the batch they are in.

The C kernel replaced oneDNN's int8 product (``qlinear_pointwise``), which reads its weights
slowly at the few rows of a decode step. Measured on the 0.5B model's shapes, weights cycled
through 24 layers so that they come from memory (2-core AMD Zen 4, AVX512-VNNI, bfloat16
activations): the MLP's [1 x 896] x [896 x 9728] product 0.35 ms against oneDNN int8's 0.81 ms
and bfloat16's 1.06 ms (25 GB/s of weights); at 8 rows 0.45 / 0.65 / 0.93 ms; at 512 rows
15.6 / 14.5 / 22 ms. Capped to AVX2 (no VNNI, float32 activations): 0.31 ms against 2.2 ms
(oneDNN int8) and 2.9 ms (float32) at one row, 1.2 / 2.2 / 2.9 ms at 8 rows, but 60 / 27 /
47 ms at 512 rows: without VNNI the widened products are slower than oneDNN's at prompt sizes.
ATen's weight-only ``_weight_int8pack_mm`` was 2-3x slower than bfloat16 from 8 rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_kernels, settings

_ZERO_POINT = 128  # activations: uint8 = round(x / row_scale) + 128, so |x| maps to 1..255


class Int8Packed(NamedTuple):
    """An int8 weight in the C kernel's layout, with what the product needs beside it."""

    weight: torch.Tensor  # int8, flat: blocks of 16 output channels by groups of 4 inputs
    scale: torch.Tensor  # [N] float32, per output channel
    colsum: torch.Tensor  # [N] int32: each channel's sum of its int8 values
    n: int
    k: int


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
    """Whether the C kernel takes this weight: a 2-D CPU tensor, the C kernels built, and the
    ``packed_gemm`` switch on (off, the weight-only reference runs)."""
    return (settings.current().packed_gemm and q.device.type == "cpu" and q.dim() == 2
            and cpu_kernels.available())


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> Int8Packed:
    """int8 [N, K] and its scales -> the C kernel's layout (see ``csrc/int8_linear_cpu.c``):
    channels padded to blocks of 16, inputs to groups of 4, with zeros."""
    n, k = q.shape
    blocks, groups = -(-n // 16), -(-k // 4)
    padded = q.new_zeros((blocks * 16, groups * 4))
    padded[:n, :k] = q
    packed = padded.view(blocks, 16, groups, 4).permute(0, 2, 1, 3).contiguous().view(-1)
    return Int8Packed(packed, scale.float().contiguous(), q.sum(1, dtype=torch.int32), n, k)


def unpack_int8(w: Int8Packed) -> torch.Tensor:
    """The int8 [N, K] values of a packed weight (``pack_int8``'s inverse)."""
    blocks, groups = -(-w.n // 16), -(-w.k // 4)
    plain = w.weight.view(blocks, groups, 16, 4).permute(0, 2, 1, 3).reshape(blocks * 16, -1)
    return plain[:w.n, :w.k]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (uint8 [M, K] with zero point 128, float32 scale [M, 1]) per row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-10).div_(127.0)
    xq = torch.round(x / scale).add_(_ZERO_POINT).to(torch.uint8)
    return xq, scale


def int8_linear_dynamic_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """What ``int8_linear`` computes, in torch: x [M, K] quantized per row, exact integer sums,
    scaled by the row's then the channel's scale, the bias added, rounded to x's dtype."""
    xq, row_scale = quantize_rows(x)
    sums = xq.long() @ q.long().T - _ZERO_POINT * q.long().sum(1)
    y = sums.float() * row_scale * scale.float()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def int8_linear(x: torch.Tensor, w: Int8Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] (float32 or bfloat16) @ w^T (+ bias) -> [..., N] in x's dtype, with the
    activations quantized per row (see the module's docstring)."""
    if x.dim() != 2:
        return int8_linear(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], -1)
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype)
    if x.shape[0]:  # int8_linear_cpu.c
        cpu_kernels.call("int8_linear_cpu", out.data_ptr(), x.data_ptr(), w.weight.data_ptr(),
                         w.scale.data_ptr(), w.colsum.data_ptr(),
                         0 if bias is None else bias.data_ptr(), x.shape[0], w.n, x.shape[1],
                         x.stride(0), out.stride(0), cpu_kernels.DTYPES[x.dtype],
                         torch.get_num_threads())
    return out
