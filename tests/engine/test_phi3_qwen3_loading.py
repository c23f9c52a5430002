"""Loading Phi-3's fused tensors and Qwen3's options: a fused tensor of the wrong size fails at
start-up naming it; Qwen3 with ``attention_bias`` loads its q/k/v/o biases and matches HF."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint

ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 20, block_size=8)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("phi3"), arch="phi3")


@pytest.mark.parametrize(("tensor", "message"), [
    ("model.layers.1.self_attn.qkv_proj.weight",
     r"tensor model.layers.1.self_attn.qkv_proj.weight: fused qkv_proj: expected 128 rows, "
     r"checkpoint gives \(127, 64\)"),
    ("model.layers.0.mlp.gate_up_proj.weight",
     r"tensor model.layers.0.mlp.gate_up_proj.weight: fused gate_up_proj: expected 256 rows, "
     r"checkpoint gives \(255, 64\)"),
])
def test_fused_tensor_of_the_wrong_size_is_named(phi3, tmp_path, tensor, message):
    for f in phi3.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(phi3 / "model.safetensors")
    weights[tensor] = weights[tensor][:-1].clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), **ENGINE)


def test_phi3_refuses_attention_bias(phi3, tmp_path):
    for f in phi3.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((phi3 / "config.json").read_text()) | {"attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="attention_bias=true is not supported for "
                                         "Phi3ForCausalLM"):
        LLM(str(tmp_path), **ENGINE)


def test_qwen3_with_attention_bias_matches_hugging_face(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "qwen3", arch="qwen3", attention_bias=True)
    names = load_file(path / "model.safetensors").keys()
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias",
            "model.layers.0.self_attn.q_norm.weight"} <= set(names)
    prompt = [0, 5, 600, 601, 33, 42, 99, 7, 8, 9, 10, 11, 250, 251, 252, 253, 254]
    llm = LLM(str(path), **ENGINE)
    got = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                      do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref and len(set(ref)) > 4


def test_an_auto_map_beside_a_supported_architecture_is_ignored(phi3, tmp_path, caplog):
    """Phi-3's published config.json names its remote code in ``auto_map`` besides
    ``Phi3ForCausalLM``: pagedserve's own Phi-3 is used (the code is never run) and the output
    is the same as without it; the log says the auto_map was ignored."""
    for f in phi3.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "modeling_phi3.py").write_text("raise SystemExit('remote code ran')\n")
    cfg = json.loads((phi3 / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_phi3.Phi3Config",
                       "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": [0, 5, 9, 200]}]
    with caplog.at_level("INFO", logger="engine.models.hf_config"):
        got = LLM(str(tmp_path), **ENGINE).generate(prompt, params, use_tqdm=False)
    want = LLM(str(phi3), **ENGINE).generate(prompt, params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert "ignoring auto_map (AutoConfig -> configuration_phi3.Phi3Config" in caplog.text
