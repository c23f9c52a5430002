from __future__ import annotations

from typing import overload

import torch
from torch import nn

from kernels import ops


class RMSNorm(nn.Module):
    """RMSNorm; given ``residual`` it first adds ``x`` into it (in place) and returns both."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (the checkpoint stores the offset from one),
    computed in float32 and rounded to x's dtype once, as HF's Gemma does (Llama rounds before
    the weight). Given ``residual`` it first adds ``x`` into it (in place) and returns both.
    ``prepare()`` after loading keeps ``1 + weight`` in float32."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden), requires_grad=False)
        self.scale: torch.Tensor | None = None

    def prepare(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual.add_(x)
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        if x.dtype == torch.float32:  # the kernels' arithmetic is Gemma's in float32
            out = ops.rms_norm(x, scale, self.eps)
        else:
            xf = x.float()
            out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale)
            out = out.to(x.dtype)
        return out if residual is None else (out, residual)
