"""Tensor-parallel process-group helpers.

With one rank (the default) every collective is the identity, so layers can be written
tensor-parallel-ready and still run as plain layers. ``torch.distributed`` with NCCL (CUDA) or
gloo (CPU) backs them when a group has been initialised.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's ``x`` along the last dimension on rank 0 (None elsewhere)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator
