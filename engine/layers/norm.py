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
