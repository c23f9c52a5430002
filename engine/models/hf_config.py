"""The subset of a Hugging Face ``config.json`` the Llama family needs, read and checked once.

Reading the JSON directly (rather than through transformers' config classes) accepts both the
older layout (``rope_theta`` and ``rope_scaling`` at top level) and the newer
``rope_parameters``; anything unsupported is refused with its name, and so is a wrong type or
value (they would otherwise surface later as an error about something else), and an
``auto_map`` (code shipped with the checkpoint, which is never run).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.layers.rotary import SUPPORTED_ROPE_TYPES
from engine.models.architectures import (
    architecture_class,
    check_architecture,
    supported_architectures,
)
from engine.models.quant_config import CheckpointQuant, parse_checkpoint_quant

logger = logging.getLogger(__name__)


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
    rope: dict[str, Any]
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: list[int]
    quantization: CheckpointQuant | None = None  # the checkpoint's own (quantization_config)
    # The served length, set by the model runner before it builds the model (LongRoPE picks
    # its factors by it); None: max_position.
    max_model_len: int | None = None
    # The whole config.json, for the fields only one architecture reads (its model class's
    # ``check_config`` validates them).
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | Path) -> HFConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder}: no config.json (is it a Hugging Face checkpoint?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> HFConfig:
        check_no_remote_code(raw, where, _names_a_supported_architecture(raw))
        arch = check_architecture(raw.get("architectures"), where)
        _check_fields(raw, where)
        architecture_class(arch).check_config(raw, where)
        quantization = parse_checkpoint_quant(raw.get("quantization_config"), where)
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"{where}: rope type {kind!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}")
        heads = raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        if not raw.get("head_dim") and raw["hidden_size"] % heads:
            raise ValueError(f"{where}: hidden_size ({raw['hidden_size']}) is not a multiple of "
                             f"num_attention_heads ({heads}) and head_dim is not given")
        eos = raw.get("eos_token_id")
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
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
            quantization=quantization,
            raw=raw,
        )


_REQUIRED_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "vocab_size")
_OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_OPTIONAL_NUMBERS = ("rms_norm_eps", "rope_theta")


def _check_fields(raw: dict[str, Any], where: str) -> None:
    """Types and ranges of the fields the model is built from; ``ValueError`` naming them."""
    missing = [k for k in _REQUIRED_INTS if not _is_int(raw.get(k))]
    if missing:
        raise ValueError(f"{where}: missing or non-integer fields: {', '.join(missing)}")
    wrong = [k for k in _OPTIONAL_INTS if raw.get(k) is not None and not _is_int(raw[k])]
    wrong += [k for k in _OPTIONAL_NUMBERS if raw.get(k) is not None
              and (isinstance(raw[k], bool) or not isinstance(raw[k], (int, float)))]
    if wrong:
        raise ValueError(f"{where}: fields of the wrong type: "
                         + ", ".join(f"{k}={raw[k]!r}" for k in wrong))
    bad = [k for k in (*_REQUIRED_INTS, *_OPTIONAL_INTS) if raw.get(k) is not None and raw[k] < 1]
    if bad:
        raise ValueError(f"{where}: fields must be positive: "
                         + ", ".join(f"{k}={raw[k]}" for k in bad))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_no_remote_code(raw: dict[str, Any], where: str, supported: bool = False) -> None:
    """An ``auto_map`` names Python code shipped with the checkpoint, and that code is never run
    here (there is no ``trust_remote_code``). Where the file also names an architecture
    pagedserve implements (``supported``; Phi-3's published checkpoints carry one), that
    implementation is used and the ``auto_map`` is ignored, as vLLM does; else it is refused."""
    auto_map = raw.get("auto_map")
    if not auto_map:
        return
    entries = auto_map.items() if isinstance(auto_map, dict) else [("auto_map", auto_map)]
    shown = ", ".join(f"{k} -> {v}" for k, v in entries)
    if supported:
        logger.info("%s: ignoring auto_map (%s): pagedserve's own implementation of %s is used",
                    where, shown, ", ".join(map(str, raw["architectures"])))
        return
    raise ValueError(f"{where}: auto_map asks to run code shipped with the checkpoint ({shown}); "
                     "pagedserve never runs checkpoint code (there is no trust_remote_code) and "
                     "implements none of its architectures")


def _names_a_supported_architecture(raw: dict[str, Any]) -> bool:
    archs = raw.get("architectures")
    return isinstance(archs, list) and any(a in supported_architectures() for a in archs)


def resolve_max_model_len(requested: int | None, hf: HFConfig) -> int:
    """``max_model_len`` checked against the checkpoint (None: the model's own limit)."""
    limit = hf.max_position
    if requested is None:
        requested = limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is over the model's "
                         f"max_position_embeddings={limit}")
    return requested
