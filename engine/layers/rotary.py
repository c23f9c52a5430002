"""Rotary position embedding (NeoX / HF-Llama layout) with a precomputed cos/sin cache."""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn

from kernels import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by ``factor``, short ones kept, a
    smooth blend between."""
    factor = rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_len / high, inv_freq, out)


# One cos/sin table per (shape, rope, device), shared by every layer that asks while any holds
# it: [max_position, head_dim] float32 is 64 MiB at 128k positions and head size 128, and a
# model's layers all ask for the same one (a copy per layer was 2 GiB for Llama-3.1-8B).
_SHARED: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = weakref.WeakValueDictionary()


def cos_sin_table(head_dim: int, max_position: int, theta: float,
                  rope: dict[str, Any]) -> torch.Tensor:
    """[max_position, head_dim] float32 (cos | sin) on the current default device, shared."""
    device = torch.empty(0).device
    key = (head_dim, max_position, theta, json.dumps(rope, sort_keys=True), str(device))
    table = _SHARED.get(key)
    if table is None:
        kind = rope.get("rope_type", rope.get("type", "default"))
        inv_freq = _inv_freq(head_dim, theta)
        positions = torch.arange(max_position, dtype=torch.float64)
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope)
        elif kind == "linear":
            positions = positions / rope["factor"]
        freqs = torch.outer(positions, inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
        _SHARED[key] = table
    return table


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cos | sin (shared buffer)

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 rope: dict[str, Any] | None = None):
        super().__init__()
        rope = dict(rope or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {kind!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        self.head_dim = head_dim
        self.register_buffer("cos_sin_cache", cos_sin_table(head_dim, max_position, theta, rope),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)
        return q, k
