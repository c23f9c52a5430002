"""Small random-weight checkpoints of real architectures, written with transformers.

``initializer_range=0.2`` (not the default 0.02) makes outputs depend on the context, so a
bug in positions, caching or batching changes the tokens instead of hiding behind a model that
repeats one token forever.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")

BASE = dict(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)


def make_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0,
                    shard_size: str | None = None, dtype=torch.float32, **overrides) -> Path:
    """Write a random ``arch`` ("llama", "qwen2", "mistral") checkpoint with the default
    model's tokenizer to ``path``; ``shard_size`` (e.g. "200KB") writes sharded safetensors."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    from engine.default_model import default_model_path

    classes = {"llama": (LlamaConfig, LlamaForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = dict(BASE, **overrides)
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    path = Path(path)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    src = default_model_path()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return path
