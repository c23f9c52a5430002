"""The subset of a Hugging Face ``config.json`` the Llama family needs, read and checked once.

Reading the JSON directly (rather than through transformers' config classes) accepts both the
older layout (``rope_theta`` and ``rope_scaling`` at top level) and the newer
``rope_parameters``; anything unsupported is refused with its name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.layers.rotary import SUPPORTED_ROPE_TYPES


@dataclass
class HFConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope: dict
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: list[int]

    @classmethod
    def load(cls, folder: str | Path) -> HFConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder}: no config.json (is it a Hugging Face checkpoint?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> HFConfig:
        from engine.models.registry import check_architecture

        arch = check_architecture(raw.get("architectures"), where)
        required = ["hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "vocab_size"]
        missing = [k for k in required if not isinstance(raw.get(k), int)]
        if missing:
            raise ValueError(f"{where}: missing or non-integer fields: {', '.join(missing)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported "
                             "(supported: silu)")
        if raw.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias=true is not supported")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{where}: rope type {kind!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            rope=rope,
            max_position=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            o_bias=bool(raw.get("attention_bias", False)),
            sliding_window=window,
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )
