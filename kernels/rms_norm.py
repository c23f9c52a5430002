"""RMSNorm and fused residual-add + RMSNorm.

Numerics follow Hugging Face Llama: the sum of squares is taken in float32, the normalised row
is rounded to the input dtype and then multiplied by the weight. The fused variant rounds the new
residual to the residual's dtype (it is stored there) and normalises that stored value.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton  # noqa: F401  (kernel added next)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H] in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual in place; returns (rms_norm(residual) * weight, residual)."""
    residual.copy_(x.float() + residual.float())
    return rms_norm_ref(residual, weight, eps).to(x.dtype), residual
