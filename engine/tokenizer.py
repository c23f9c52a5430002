"""Tokenizer loading (transformers' fast tokenizers; never remote code) and EOS ids."""

from __future__ import annotations

import json
from pathlib import Path

from engine.models.hf_config import HFConfig


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a broken tokenizer folder
        raise ValueError(f"{model_path}: cannot load the tokenizer ({type(e).__name__}: {e})") \
            from None


def eos_token_ids(model_path: str, hf: HFConfig, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    ids = set(hf.eos_token_ids)
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
