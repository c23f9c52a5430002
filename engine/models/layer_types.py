"""Which decoder layers attend through a sliding window, read from config.json.

Hugging Face's rule, per architecture family: ``layer_types`` ("sliding_attention" /
"full_attention" per layer) when config.json lists them; else Gemma's pattern (every
``pattern``-th layer global, the others sliding: Gemma 2 alternates, Gemma 3's
``sliding_window_pattern`` defaults to 6); else Qwen2's and Qwen3's (layers from
``max_window_layers`` on, when ``use_sliding_window``); else every layer (Mistral, Mixtral,
Phi-3, Qwen3-MoE). Llama has no window.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from engine.layers.attention import Attention
from engine.models.hf_config import HFConfig

LAYER_TYPES = ("sliding_attention", "full_attention")


def check_layer_types(raw: dict[str, Any], where: str) -> None:
    """``ValueError`` naming the field for a malformed ``layer_types`` or ``sliding_window``."""
    types = raw.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != raw["num_hidden_layers"]
                              or any(t not in LAYER_TYPES for t in types)):
        raise ValueError(f"{where}: layer_types must list one of {', '.join(LAYER_TYPES)} for "
                         f"each of the {raw['num_hidden_layers']} layers, got {types!r}")
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"{where}: sliding_window must be a positive integer or null, "
                         f"got {window!r}")


def sliding_windows(cfg: HFConfig, pattern: int | None = None,
                    window: int | None = None) -> list[int]:
    """Each layer's window in keys, 0 for global attention; ``pattern``: Gemma's layer
    pattern, ``window``: the window when config.json gives none (Gemma's default)."""
    window, n = cfg.sliding_window or window or 0, cfg.num_layers
    types = cfg.raw.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        return [window if t == "sliding_attention" else 0 for t in types]
    if pattern is not None:
        return [window if (i + 1) % pattern else 0 for i in range(n)]
    if cfg.architecture == "LlamaForCausalLM":
        return [0] * n
    if cfg.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = cfg.raw.get("max_window_layers", 28)
        return [window if i >= first else 0 for i in range(n)]
    return [window] * n


def set_sliding_windows(layers: Iterable[nn.Module], windows: list[int]) -> None:
    """Give the ``Attention`` of each decoder layer (in order) its window."""
    attns = [m for layer in layers for m in layer.modules() if isinstance(m, Attention)]
    if len(attns) != len(windows):
        raise ValueError(f"{len(windows)} layer windows for {len(attns)} attention layers")
    for attn, window in zip(attns, windows, strict=True):
        attn.sliding_window = window
