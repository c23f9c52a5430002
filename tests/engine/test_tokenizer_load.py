"""load_tokenizer chooses the tokenizer class as AutoTokenizer does, from config.json's
model_type, without building the model's config class (#53: its import took seconds of a
Worker's start)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.default_model import default_model_path
from engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# every architecture the engine serves; qwen2 is one AutoTokenizer maps to its own class
MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "phi3", "mixtral", "qwen3_moe", "gemma2",
               "gemma3_text")
TEXT = "Hello <|im_start|> wörld 12345 \t  tabs\nand lines"


def _folder(tmp_path: Path, model_type: str, tokenizer_class: str | None = "keep") -> Path:
    folder = tmp_path / model_type
    folder.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer_class != "keep":
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg.pop("tokenizer_class")
        if tokenizer_class is not None:
            cfg["tokenizer_class"] = tokenizer_class
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.encode(TEXT) == b.encode(TEXT)
    assert a.decode(a.encode(TEXT)) == b.decode(b.encode(TEXT))
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == \
        (b.bos_token_id, b.eos_token_id, b.pad_token_id)
    assert a.all_special_ids == b.all_special_ids and len(a) == len(b)
    assert a.chat_template == b.chat_template


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_same_tokenizer_as_auto_tokenizer(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, model_type)
    _same(load_tokenizer(str(folder)), AutoTokenizer.from_pretrained(str(folder)))


def test_without_a_named_class_auto_tokenizer_decides(tmp_path: Path) -> None:
    """No tokenizer_class anywhere: AutoTokenizer picks by the config's class (qwen2's own)."""
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, "qwen2", tokenizer_class=None)
    tok = load_tokenizer(str(folder))
    _same(tok, AutoTokenizer.from_pretrained(str(folder)))
    assert type(tok).__name__ == "Qwen2Tokenizer"


def test_model_config_class_not_imported() -> None:
    """In a fresh interpreter, loading the default model's tokenizer leaves its config class
    (and what its module imports) unimported."""
    code = ("import sys; from engine.tokenizer import load_tokenizer; "
            "from engine.models.default_model import default_model_path; "
            "tok = load_tokenizer(str(default_model_path())); "
            "print(type(tok).__name__, "
            "'transformers.models.llama.configuration_llama' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["TokenizersBackend", "False"]
