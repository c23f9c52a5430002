"""Tokenizer loading (transformers' fast tokenizers; never remote code: an ``auto_map`` in
``tokenizer_config.json`` is refused), its fit to the model's vocabulary, and EOS ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.models.hf_config import HFConfig, check_no_remote_code

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PromptType = str | Sequence[int] | dict[str, Any]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    folder = Path(model_path)
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(f"{model_path}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    serialized = folder / "tokenizer.json"
    if serialized.is_file():
        try:
            json.loads(serialized.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{serialized}: not valid JSON ({e})") from None
    config, raw = folder / "tokenizer_config.json", None
    if config.is_file():
        try:
            raw = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config}: not valid JSON ({e})") from None
        if isinstance(raw, dict):
            check_no_remote_code(raw, str(config))
    named = _ModelTypeConfig.read(model_path, raw)
    if named is not None:
        try:
            return AutoTokenizer.from_pretrained(model_path, config=named, trust_remote_code=False)
        except Exception:  # noqa: BLE001 - the full resolution below says what is wrong
            pass
    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a broken tokenizer folder
        raise ValueError(f"{model_path}: cannot load the tokenizer ({type(e).__name__}: {e})") \
            from None


class _ModelTypeConfig:
    """What ``AutoTokenizer`` reads of a model's config to choose the tokenizer class, from
    ``config.json`` itself. Without it AutoTokenizer builds the model's config class, whose
    import (``transformers.activations`` -> ``torch.distributed.tensor``) took 1.5-2.2 s of a
    Worker's start for a tokenizer that loads in milliseconds (#53). Only where a tokenizer
    class is named (in ``tokenizer_config.json`` or ``config.json``): without one, AutoTokenizer
    picks by the config's class, which this is not."""

    def __init__(self, path: str, raw: dict[str, Any]) -> None:
        self._name_or_path, self.model_type = path, raw["model_type"]
        self.tokenizer_class = raw.get("tokenizer_class")
        if "model_name" in raw:  # AutoTokenizer asks hasattr(config, "model_name")
            self.model_name = raw["model_name"]

    @classmethod
    def read(cls, model_path: str, tokenizer_config: Any) -> _ModelTypeConfig | None:
        try:
            raw = json.loads((Path(model_path) / "config.json").read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
            return None
        named = raw.get("tokenizer_class")
        tok_named = tokenizer_config.get("tokenizer_class") \
            if isinstance(tokenizer_config, dict) else None
        if not isinstance(tok_named, str) and not isinstance(named, str):
            return None
        return cls(model_path, raw)


def check_vocab(model_path: str, hf: HFConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Every id the tokenizer can produce must have an embedding row: a text prompt that
    tokenized to a larger id would fail the engine step it is in, with every request in it."""
    if len(tokenizer) > hf.vocab_size:
        raise ValueError(f"{model_path}: the tokenizer has {len(tokenizer)} tokens but "
                         f"config.json's vocab_size is {hf.vocab_size}")


def eos_token_ids(model_path: str, hf: HFConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
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


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: PromptType, vocab_size: int, max_model_len: int,
                  truncate: int | None = None) -> tuple[str | None, list[int]]:
    """A prompt (text, token ids, or a dict with 'prompt' or 'prompt_token_ids') as its text
    (None for ids) and token ids (``truncate``: only the last N), checked: ``ValueError``
    naming the problem."""
    text = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        text, ids = prompt, list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab_size - 1}], "
                             f"got {bad[:5]}")
    if not ids:
        raise ValueError("prompt must not be empty")
    ids = ids[-truncate:] if truncate else ids
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt is {len(ids)} tokens long; max_model_len is {max_model_len}, "
                         f"so prompts may have at most {max_model_len - 1} tokens")
    return text, ids
