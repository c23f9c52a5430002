"""A malformed checkpoint fails at start-up with a message naming what is wrong, and no code
from the checkpoint folder ever runs.

Each case copies one good random Llama (``tests/checkpoints.py``), breaks one thing and starts
an engine on it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM
from tests.checkpoints import make_checkpoint

MARKER = "pagedserve-checkpoint-code-ran"
EVIL = f"open(__file__ + '.{MARKER}', 'w').write('ran')\nclass MyForCausalLM: pass\n"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("good") / "llama")


def start(path: Path) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)


def edit_json(path: Path, **changes) -> None:
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))


def edit_weights(folder: Path, fn) -> None:
    tensors = load_file(folder / "model.safetensors")
    fn(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def to_bin(folder: Path) -> None:
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def shard_index_to_missing_file(folder: Path) -> None:
    names = list(load_file(folder / "model.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def remote_code_config(folder: Path) -> None:
    (folder / "modeling_my.py").write_text(EVIL)
    edit_json(folder / "config.json", architectures=["MyForCausalLM"],
              auto_map={"AutoModelForCausalLM": "modeling_my.MyForCausalLM"})


def remote_code_tokenizer(folder: Path) -> None:
    (folder / "tokenization_my.py").write_text(EVIL)
    edit_json(folder / "tokenizer_config.json", tokenizer_class="MyTokenizer",
              auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]})


CASES = {
    "missing_tensor": (lambda d: edit_weights(d, lambda t: t.pop(
        "model.layers.1.mlp.down_proj.weight")),
        r"checkpoint is missing tensors: model\.layers\.1\.mlp\.down_proj\.weight"),
    "wrong_shape": (lambda d: edit_weights(d, lambda t: t.update({
        "model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 32)})),
        r"tensor model\.layers\.0\.self_attn\.o_proj\.weight: .*expected shape \(64, 64\), "
        r"checkpoint gives \(64, 32\)"),
    "config_not_json": (lambda d: (d / "config.json").write_text('{"hidden_size": 64,'),
                        r"config\.json: not valid JSON"),
    "config_not_an_object": (lambda d: (d / "config.json").write_text("[64]"),
                             r"config\.json: expected a JSON object, got list"),
    "config_missing": (lambda d: (d / "config.json").unlink(), r"no config\.json"),
    "field_missing": (lambda d: edit_json(d / "config.json", hidden_size=None),
                      r"config\.json: missing or non-integer fields: hidden_size"),
    "field_wrong_type": (lambda d: edit_json(d / "config.json", num_key_value_heads="2"),
                         r"config\.json: fields of the wrong type: num_key_value_heads='2'"),
    "field_zero": (lambda d: edit_json(d / "config.json", num_attention_heads=0),
                   r"config\.json: fields must be positive: num_attention_heads=0"),
    "heads_do_not_divide": (lambda d: edit_json(d / "config.json", num_key_value_heads=3),
                            r"num_attention_heads \(4\) is not a multiple of "
                            r"num_key_value_heads \(3\)"),
    "architecture_unsupported": (lambda d: edit_json(d / "config.json",
                                                     architectures=["GPT2LMHeadModel"]),
                                 r"architecture GPT2LMHeadModel is not supported; supported: "
                                 r"Gemma2ForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM"),
    "architecture_missing": (lambda d: edit_json(d / "config.json", architectures=None),
                             r"'architectures' is missing"),
    "tokenizer_not_json": (lambda d: (d / "tokenizer.json").write_text('{"model": '),
                           r"tokenizer\.json: not valid JSON"),
    "tokenizer_missing": (lambda d: [p.unlink() for p in d.glob("tokenizer*")],
                          r"no tokenizer files \(tokenizer\.json, tokenizer\.model"),
    "tokenizer_over_vocab": (lambda d: edit_json(d / "config.json", vocab_size=100),
                             r"the tokenizer has \d+ tokens but config\.json's vocab_size is 100"),
    "no_safetensors": (lambda d: (d / "model.safetensors").unlink(),
                       r"no \*\.safetensors files \(only safetensors checkpoints load\)$"),
    "bin_only": (to_bin, r"no \*\.safetensors files .*found pytorch_model\.bin: pickled PyTorch "
                         r"weights, which are never loaded"),
    "safetensors_garbage": (lambda d: (d / "model.safetensors").write_bytes(b"\0" * 64),
                            r"model\.safetensors: not a readable safetensors file"),
    "safetensors_truncated": (lambda d: truncate(d / "model.safetensors"),
                              r"model\.safetensors: not a readable safetensors file"),
    "index_names_missing_shard": (shard_index_to_missing_file,
                                  r"index\.json names missing files: "
                                  r"model-00001-of-00002\.safetensors"),
    "auto_map_model": (remote_code_config,
                       r"config\.json: auto_map asks to run code shipped with the checkpoint "
                       r"\(AutoModelForCausalLM -> modeling_my\.MyForCausalLM\); pagedserve "
                       r"never runs checkpoint code"),
    "auto_map_tokenizer": (remote_code_tokenizer,
                           r"tokenizer_config\.json: auto_map asks to run code shipped with the "
                           r"checkpoint \(AutoTokenizer -> \['tokenization_my\.MyTokenizer'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_fails_at_start_up_naming_the_problem(good, tmp_path, case):
    breaker, message = CASES[case]
    folder = tmp_path / case
    shutil.copytree(good, folder)
    breaker(folder)
    with pytest.raises(ValueError, match=message):
        start(folder)
    assert not list(folder.glob(f"*{MARKER}")), "code from the checkpoint folder ran"


def test_python_files_in_a_good_checkpoint_are_never_imported(good, tmp_path):
    folder = tmp_path / "with-code"
    shutil.copytree(good, folder)
    for name in ("modeling_llama.py", "configuration_llama.py", "tokenization_llama.py",
                 "__init__.py"):
        (folder / name).write_text(EVIL)
    llm = start(folder)
    assert llm.get_tokenizer() is not None
    assert not list(folder.glob(f"*{MARKER}"))
