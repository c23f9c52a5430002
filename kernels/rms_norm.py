"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow Hugging Face Llama: the sum of squares is taken in float32, the normalised row
is rounded to the input dtype and then multiplied by the weight. The fused variant rounds the new
residual to the residual's dtype (it is stored there) and normalises that stored value.
"""

from __future__ import annotations

import torch

from kernels._triton import next_power_of_2, tl, triton


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H] in x's dtype."""
    if x.dtype == torch.float32:
        normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    else:  # torch's fused kernel accumulates in float32 and rounds the normalised row once
        normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)
    return normed * weight.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual in place; returns (rms_norm(residual) * weight, residual)."""
    residual.add_(x)  # bfloat16/float16 add in float32 and round once, like the float32 sum did
    return rms_norm_ref(residual, weight, eps).to(x.dtype), residual


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H] output, x's dtype, contiguous
    x_ptr,  # [T, H] input, rows strided by stride_x, last dim contiguous
    residual_ptr,  # [T, H] residual, x's dtype, updated in place (read only if HAS_RESIDUAL)
    weight_ptr,  # [H]
    stride_out,  # row stride of out (elements)
    stride_x,  # row stride of x
    stride_res,  # row stride of residual
    hidden,  # H
    eps,
    HAS_RESIDUAL: tl.constexpr,  # fused residual add
    BLOCK_H: tl.constexpr,  # next power of two >= H: one program normalises one whole row
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + row * stride_res + cols
        x += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        stored = x.to(residual_ptr.dtype.element_ty)
        tl.store(res_ptrs, stored, mask=mask)
        x = stored.to(tl.float32)  # normalise exactly what the residual now holds
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before weight
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], ref: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device}, expected {ref.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    tokens, hidden = x.shape
    _check_rows("x", x, (tokens, hidden), x)
    _check_rows("weight", weight, (hidden,), x)
    if residual is not None:
        _check_rows("residual", residual, (tokens, hidden), x)
        if residual.dtype != x.dtype:
            raise ValueError(f"residual dtype {residual.dtype} must equal x dtype {x.dtype}")
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    block = next_power_of_2(hidden)
    res = residual if residual is not None else x
    _rms_norm_kernel[(tokens,)](
        out, x, res, weight, out.stride(0), x.stride(0), res.stride(0), hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block,
        num_warps=min(max(block // 256, 1), 16),
    )
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm: x [T, H], weight [H] -> [T, H] in x's dtype."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused add + RMSNorm: residual <- x + residual in place; returns (normed, residual)."""
    return _launch(x, residual, weight, eps), residual
