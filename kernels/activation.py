"""SiLU-and-multiply, the gated MLP activation: silu(gate) * up, computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import tl, triton  # noqa: F401  (kernel added next)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] (gate | up) -> silu(gate) * up, [T, I] in x's dtype."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
