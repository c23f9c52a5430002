"""Pre-quantized checkpoints in the compressed-tensors format, made by the compressed-tensors
library itself (``tests/checkpoints.make_compressed_checkpoint``) from random models.

Loading: the int8 values and scales the engine holds are the file's, row for row (q/k/v and
gate/up fused, packed int32 words unpacked). Quality against the unquantized checkpoint, with
the checks of ``test_quantization.py``: int8 with its bounds (0.01 nats, 0.3-nat margins;
measured 0.004-0.005); FP8 E4M3 has 3 mantissa bits, a relative error per weight about 8x
int8's, and these models give a mean KL of 0.03-0.04 nats (greedy flips up to 1-nat margins):
bounds of 0.1 nats and 1.2-nat margins (4 to 8 positions of 64 lead by more); with the fp8
KV scheme's scales used by an fp8 cache, the same bounds. Refusals: every scheme the engine
does not run is a start-up error naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from engine import LLM
from engine.layers.linear import LinearBase
from engine.models.quant_config import parse_checkpoint_quant
from tests.checkpoints import COMPRESSED_SCHEMES, make_checkpoint, make_compressed_checkpoint
from tests.engine.test_quantization import COMMON, GREEDY, PROMPTS, assert_close_to_float

BOUNDS = {"int8": dict(mean_kl=0.01, margin=0.3),
          "fp8": dict(mean_kl=0.1, margin=1.2, min_clear=4)}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def source(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param)
    llm = LLM(str(path), **COMMON)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return path, llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("scheme", COMPRESSED_SCHEMES)
def test_compressed_checkpoint_generates_close_to_its_source(source, scheme, tmp_path):
    src, ref_llm, ref_tokens = source
    path = make_compressed_checkpoint(src, tmp_path / scheme, scheme)
    llm = LLM(str(path), **COMMON)
    assert llm.engine.quantization == f"compressed-tensors:{scheme}"
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quantization == scheme.split("-")[0] for m in linears)
    assert llm.engine.runner.model.lm_head.weight_scale is None  # left out, as in the file
    assert_close_to_float(ref_llm, ref_tokens, llm, **BOUNDS[scheme.split("-")[0]])


@pytest.mark.parametrize("scheme", ["int8-w8a8", "int8-w8a16"])
def test_int8_values_and_scales_are_the_files(source, scheme, tmp_path):
    """Weight-only reference path (no prepacking), so the int8 weights stay readable."""
    path = make_compressed_checkpoint(source[0], tmp_path / scheme, scheme)
    fmt = json.loads((path / "config.json").read_text())["quantization_config"]["format"]
    assert fmt == ("int-quantized" if scheme == "int8-w8a8" else "pack-quantized")
    llm = LLM(str(path), cpu_packed_gemm=False, **COMMON)
    attn = llm.engine.runner.model.model.layers[1].self_attn
    mlp = llm.engine.runner.model.model.layers[1].mlp
    prefix = "model.layers.1."
    with safe_open(path / "model.safetensors", "pt") as f:
        def file_weight(name: str) -> torch.Tensor:
            if fmt == "int-quantized":
                return f.get_tensor(f"{prefix}{name}.weight")
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            shape = torch.Size(f.get_tensor(f"{prefix}{name}.weight_shape").tolist())
            return unpack_from_int32(f.get_tensor(f"{prefix}{name}.weight_packed"), 8, shape)

        rows = 0
        for name in ("q_proj", "k_proj", "v_proj"):
            want = file_weight(f"self_attn.{name}")
            n = want.shape[0]
            assert torch.equal(attn.qkv_proj.weight[rows:rows + n], want)
            scale = f.get_tensor(f"{prefix}self_attn.{name}.weight_scale").float().reshape(-1)
            assert torch.equal(attn.qkv_proj.weight_scale[rows:rows + n], scale)
            rows += n
        assert rows == attn.qkv_proj.weight.shape[0]
        gate, up = file_weight("mlp.gate_proj"), file_weight("mlp.up_proj")
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate, up]))
        assert torch.equal(mlp.down_proj.weight, file_weight("mlp.down_proj"))
        assert mlp.down_proj.weight.dtype == torch.int8


def test_a_bad_scale_is_a_clear_error(source, tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_compressed_checkpoint(source[0], tmp_path / "bad", "int8-w8a8")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_scale"][3] = -1.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj.weight_scale: scales must be finite"):
        LLM(str(path), **COMMON)


def _config(weights: dict, inputs: dict | None = None, **top) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                "symmetric": True, "strategy": "channel",
                                                **weights}}
    if inputs is not None:
        group["input_activations"] = inputs
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], **top}


@pytest.mark.parametrize("raw, message", [
    (_config({"num_bits": 4}), "num_bits 4"),
    (_config({"strategy": "group", "group_size": 128}), "strategy group"),
    (_config({"strategy": "tensor"}), "strategy tensor"),
    (_config({"symmetric": False}), "symmetric False"),
    (_config({}, {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}),
     "dynamic per-token"),
    (_config({}, kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor"}),
     "kv_cache_scheme .* is not supported"),
    (_config({}, kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "attn_head"}),
     "kv_cache_scheme .* is not supported"),
    (_config({}, ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "only lm_head"),
    (_config({"type": "float"}), "format 'int-quantized' is not supported for float"),
    ({**_config({}), "config_groups": {}}, "0 config_groups"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    (_config({"num_bits": "eight"}), "quantization_config"),
])
def test_unsupported_schemes_are_refused_naming_them(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_checkpoint_quant(raw)


def test_supported_schemes_parse():
    assert parse_checkpoint_quant(None) is None
    q = parse_checkpoint_quant(_config({}, {"num_bits": 8, "type": "int", "strategy": "token",
                                            "dynamic": True}))
    assert (q.weight_type, q.activations, q.packed, q.label) == \
        ("int", "dynamic-token", False, "compressed-tensors:int8-w8a8")
    q = parse_checkpoint_quant({**_config({}), "format": "pack-quantized"})
    assert (q.packed, q.label, q.kv_scales) == (True, "compressed-tensors:int8-w8a16", False)
    q = parse_checkpoint_quant(_config({}, kv_cache_scheme={"num_bits": 8, "type": "float",
                                                            "strategy": "tensor"}))
    assert q.kv_scales


def test_fp8_kv_scales_are_the_files_and_used_by_an_fp8_cache(source, tmp_path):
    """A checkpoint with compressed-tensors' fp8 KV scheme: ``kv_cache_dtype="fp8"`` stores
    key / k_scale and value / v_scale and reads them back scaled, within the bounds of FP8
    weights (the weights are FP8 too); with ``auto`` the scales are read, checked and unused."""
    src, ref_llm, ref_tokens = source
    path = make_compressed_checkpoint(src, tmp_path / "kv", "fp8-w8a8", kv_scales=True)
    raw = json.loads((path / "config.json").read_text())["quantization_config"]
    assert raw["kv_cache_scheme"]["strategy"] == "tensor"
    llm = LLM(str(path), kv_cache_dtype="fp8", **COMMON)
    layers = llm.engine.runner.model.model.layers
    with safe_open(path / "model.safetensors", "pt") as f:
        for i, layer in enumerate(layers):
            for name in ("k_scale", "v_scale"):
                want = f.get_tensor(f"model.layers.{i}.self_attn.{name}").float().item()
                assert getattr(layer.self_attn.attn, name) == want != 1.0
    assert not hasattr(layers[0].self_attn, "k_scale")  # handed over, not kept as parameters
    assert_close_to_float(ref_llm, ref_tokens, llm, **BOUNDS["fp8"])
    plain = LLM(str(path), **COMMON)
    assert (plain.engine.kv_cache_dtype, plain.engine.runner.model.model.layers[0]
            .self_attn.attn.k_scale) == ("float32", 1.0)


def test_a_bad_kv_scale_is_a_clear_error(source, tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_compressed_checkpoint(source[0], tmp_path / "bad", "int8-w8a8", kv_scales=True)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.self_attn.v_scale"].fill_(float("inf"))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layers.1.self_attn: KV-cache scales must be finite"):
        LLM(str(path), kv_cache_dtype="fp8", **COMMON)
    del tensors["model.layers.0.self_attn.k_scale"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors: model.layers.0.self_attn.k_scale"):
        LLM(str(path), **COMMON)
