"""Rotary position embedding (NeoX / HF-Llama layout) with a precomputed cos/sin cache.

``rope`` is config.json's ``rope_parameters`` (or ``rope_scaling``): default, linear, llama3,
or LongRoPE (``longrope``; older Phi-3 checkpoints say ``su``). ``partial_rotary_factor``
rotates only the first part of each head (Phi-4-mini), as HF does.

LongRoPE has two lists of per-frequency divisors: ``short_factor`` for sequences within
``original_max_position_embeddings`` and ``long_factor`` beyond, and scales cos and sin by
``attention_factor`` (default sqrt(1 + log(factor) / log(original_max_position_embeddings)),
``factor`` defaulting to max_position_embeddings / original_max_position_embeddings), for both
lists. HF picks the list per forward call by that call's largest position, so a sequence that
grows past the limit attends with keys rotated by both lists. pagedserve, like vLLM, picks one
list per served model instead: ``long_factor`` when ``max_model_len`` exceeds
``original_max_position_embeddings``, else ``short_factor``, for every position. A token's
rotation then never depends on the batch, the chunking or the cached prefix; to serve a
LongRoPE model exactly as trained for short contexts, set ``max_model_len`` to
``original_max_position_embeddings`` or less.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn

from kernels import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


def rope_kind(rope: dict[str, Any]) -> str:
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    return "longrope" if kind == "su" else kind


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
    """[max_position, head_dim] float32 (cos | sin) on the current default device, shared.
    LongRoPE reads ``rope``'s ``factors`` and ``mscale`` (``longrope_params``)."""
    device = torch.empty(0).device
    key = (head_dim, max_position, theta, json.dumps(rope, sort_keys=True), str(device))
    table = _SHARED.get(key)
    if table is None:
        kind = rope_kind(rope)
        inv_freq = _inv_freq(head_dim, theta)
        positions = torch.arange(max_position, dtype=torch.float64)
        scale = 1.0
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope)
        elif kind == "linear":
            positions = positions / rope["factor"]
        elif kind == "longrope":
            inv_freq = inv_freq / torch.tensor(rope["factors"], dtype=torch.float64)
            scale = rope["mscale"]
        freqs = torch.outer(positions, inv_freq)
        table = (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scale).float()
        _SHARED[key] = table
    return table


def rotary_dim(head_dim: int, raw: dict[str, Any], rope: dict[str, Any]) -> int:
    """How many leading dimensions of each head rotate: ``partial_rotary_factor`` (the rope
    dict's, else config.json's, as HF reads it) of ``head_dim``."""
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def _original_max(rope: dict[str, Any], raw: dict[str, Any]) -> Any:
    """original_max_position_embeddings: config.json's top level first, as HF reads it."""
    return raw.get("original_max_position_embeddings",
                   rope.get("original_max_position_embeddings"))


def longrope_params(rope: dict[str, Any], raw: dict[str, Any], max_position: int,
                    max_model_len: int | None) -> dict[str, Any]:
    """The LongRoPE list this model serves with (the module docstring's rule; without a
    ``max_model_len``, ``max_position``) and the cos/sin scale, as HF computes it."""
    old_len = _original_max(rope, raw)
    factor = rope.get("factor") or max_position / old_len
    mscale = rope.get("attention_factor")
    if mscale is None:
        mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    long = (max_model_len or max_position) > old_len
    return {"rope_type": "longrope", "factors": rope["long_factor" if long else "short_factor"],
            "mscale": mscale}


def check_rope_config(raw: dict[str, Any], head_dim: int, where: str) -> None:
    """``ValueError`` naming the field for a partial rotary factor or LongRoPE field this layer
    cannot use; ``head_dim`` is the model's head size."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"{where}: partial_rotary_factor must be a number in (0, 1], "
                         f"got {factor!r}")
    dim = rotary_dim(head_dim, raw, rope)
    if dim < 2 or dim % 2:
        raise ValueError(f"{where}: partial_rotary_factor={factor} rotates {dim} of "
                         f"head_dim={head_dim} dimensions; it must be an even number")
    if rope_kind(rope) != "longrope":
        return
    old_len = _original_max(rope, raw)
    if isinstance(old_len, bool) or not isinstance(old_len, int) or old_len < 2:
        raise ValueError(f"{where}: LongRoPE needs original_max_position_embeddings, an "
                         f"integer >= 2, got {old_len!r}")
    for name in ("short_factor", "long_factor"):
        value = rope.get(name)
        if (not isinstance(value, list) or len(value) != dim // 2
                or not all(isinstance(x, (int, float)) and x > 0 for x in value)):
            raise ValueError(f"{where}: rope {name} must be a list of {dim // 2} positive "
                             f"numbers (half the rotary dimensions), got {value!r}")
    for name in ("factor", "attention_factor"):
        value = rope.get(name)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"{where}: rope {name} must be a positive number, got {value!r}")


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] float32: cos | sin (shared buffer)

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 rope: dict[str, Any] | None = None, rotary_dim: int | None = None):
        super().__init__()
        rope = dict(rope or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {kind!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.register_buffer("cos_sin_cache",
                             cos_sin_table(self.rotary_dim, max_position, theta, rope),
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            ops.rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)
            return q, k
        # Partial: the rotated part of each head gathered, rotated, written back.
        dim, tokens = self.rotary_dim, q.shape[0]
        q_heads = q.view(tokens, -1, self.head_dim)[..., :dim]
        k_heads = k.view(tokens, -1, self.head_dim)[..., :dim]
        q_rot, k_rot = q_heads.reshape(tokens, -1), k_heads.reshape(tokens, -1)
        ops.rotary_embedding(positions, q_rot, k_rot, self.cos_sin_cache, dim)
        q_heads.copy_(q_rot.view(q_heads.shape))
        k_heads.copy_(k_rot.view(k_heads.shape))
        return q, k
