from __future__ import annotations

import torch
from torch import nn

from kernels import ops


class SiluAndMul(nn.Module):
    """``[T, 2I] -> [T, I]``: silu of the first half times the second half."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """``[T, 2I] -> [T, I]``: GeGLU, gelu (tanh approximation, HF's "gelu_pytorch_tanh") of the
    first half times the second half (Gemma)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.nn.functional.gelu(x[..., :half], approximate="tanh") * x[..., half:]
