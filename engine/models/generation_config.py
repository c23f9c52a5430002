"""Default sampling parameters from a checkpoint's ``generation_config.json``, as vLLM's
``--generation-config`` reads them: the model's defaults apply to what a request leaves unset.

``generation_config`` (``ModelConfig``) says where they come from: ``auto`` the model's own
file, ``vllm`` nowhere (the neutral defaults of ``SamplingParams``), or a folder holding a
``generation_config.json``. The file's EOS ids stop generation whatever this says
(``engine.tokenizer.eos_token_ids``, as vLLM reads them under ``vllm`` too).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.core.sampling_params import SamplingParams

# generation_config.json's name -> SamplingParams' (the keys vLLM takes; do_sample is ignored)
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def default_sampling(model_path: str, setting: str = "auto") -> dict[str, Any]:
    """The ``SamplingParams`` fields the generation config sets (``{}`` when it sets none, or
    with ``setting="vllm"``), checked: a value ``SamplingParams`` refuses is a ``ValueError``
    naming the file."""
    if setting == "vllm":
        return {}
    folder = Path(model_path if setting == "auto" else setting)
    path = folder / "generation_config.json"
    if setting != "auto" and not path.is_file():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                         f"generation_config.json; {setting!r} is neither")
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {ours: raw[theirs] for theirs, ours in FIELDS.items() if raw.get(theirs) is not None}
    if defaults.get("top_k") == 0:  # transformers' "off"
        defaults["top_k"] = -1
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults
