"""SiLU-and-multiply, the gated MLP activation: silu(gate) * up.

The Triton kernel computes in float32 and rounds once. The torch reference works in the input's
dtype, as Hugging Face's ``act_fn(gate) * up`` does (silu rounded, then the product rounded): on
the CPU that is two passes over bfloat16 instead of four over float32 copies."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, next_power_of_2, tl, triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] (gate | up) -> silu(gate) * up, [T, I] in x's dtype."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]).mul_(x[..., inter:])


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I] output, contiguous
    x_ptr,  # [T, 2*I] input (gate | up), rows strided by stride_x, last dim contiguous
    stride_out,  # row stride of out (elements)
    stride_x,  # row stride of x
    inter,  # I
    BLOCK: tl.constexpr,  # columns per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-multiply: x [T, 2*I] -> [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 != 0:
        raise ValueError(f"x must be 2-D [T, 2*I], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
    tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0 or inter == 0:
        return out
    block = min(next_power_of_2(inter), 1024)
    grid = (tokens, cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        out, x, out.stride(0), x.stride(0), inter, BLOCK=block, num_warps=max(block // 256, 1)
    )
    return out
