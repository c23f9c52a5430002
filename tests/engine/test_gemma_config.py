"""Gemma 2/3 and sliding-window configuration: which layers slide, each layer's rope, and the
config.json fields refused with their names."""

from __future__ import annotations

import pytest

from engine.models.gemma import gemma3_ropes
from engine.models.hf_config import HFConfig, resolve_max_model_len
from engine.models.layer_types import sliding_windows

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=768, head_dim=16)


def config(arch: str, **fields) -> HFConfig:
    return HFConfig.from_dict({"architectures": [arch], **BASE, **fields})


def test_gemma2_alternates_sliding_and_global_layers():
    cfg = config("Gemma2ForCausalLM", sliding_window=10)
    assert sliding_windows(cfg, pattern=2) == [10, 0, 10, 0, 10, 0]


def test_gemma3_global_layer_every_pattern_th_and_default_window():
    assert sliding_windows(config("Gemma3ForCausalLM"), pattern=6, window=4096) == \
        [4096] * 5 + [0]
    assert sliding_windows(config("Gemma3ForCausalLM", sliding_window=7), pattern=3) == \
        [7, 7, 0, 7, 7, 0]


def test_layer_types_win_over_every_rule():
    types = ["full_attention", "sliding_attention"] * 3
    for arch in ("Gemma3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        cfg = config(arch, sliding_window=5, layer_types=types)
        assert sliding_windows(cfg, pattern=6 if "Gemma" in arch else None) == [0, 5] * 3


def test_llama_family_windows():
    assert sliding_windows(config("MistralForCausalLM", sliding_window=9)) == [9] * 6
    assert sliding_windows(config("MistralForCausalLM", sliding_window=None)) == [0] * 6
    assert sliding_windows(config("LlamaForCausalLM", sliding_window=9)) == [0] * 6
    qwen2 = config("Qwen2ForCausalLM", sliding_window=9, use_sliding_window=True,
                   max_window_layers=4)
    assert sliding_windows(qwen2) == [0, 0, 0, 0, 9, 9]
    assert sliding_windows(config("Qwen2ForCausalLM", sliding_window=9)) == [0] * 6


def test_max_model_len_may_exceed_the_window():
    cfg = config("MistralForCausalLM", sliding_window=16, max_position_embeddings=512)
    assert resolve_max_model_len(512, cfg) == 512


def test_gemma3_ropes_from_both_config_layouts():
    new = {"rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert gemma3_ropes(new) == ((1e6, {"rope_type": "linear", "factor": 8.0,
                                        "rope_theta": 1e6}),
                                 (1e4, {"rope_type": "default", "rope_theta": 1e4}))
    old = {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
           "rope_local_base_freq": 2e4}
    assert gemma3_ropes(old) == ((5e5, {"rope_type": "linear", "factor": 4.0}), (2e4, {}))
    assert gemma3_ropes({}) == ((1e6, {}), (1e4, {}))


@pytest.mark.parametrize("arch,fields,message", [
    ("Gemma2ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ("Gemma2ForCausalLM", {"layer_types": ["sliding_attention"]}, "layer_types must list"),
    ("Gemma2ForCausalLM", {"layer_types": ["local"] * 6}, "layer_types must list"),
    ("Gemma2ForCausalLM", {"sliding_window": 0}, "sliding_window must be a positive"),
    ("Gemma2ForCausalLM", {"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be"),
    ("Gemma2ForCausalLM", {"final_logit_softcapping": "30"}, "final_logit_softcapping must be"),
    ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"sliding_window_pattern": 0}, "sliding_window_pattern must be"),
    ("Gemma3ForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "yarn"},
                                               "sliding_attention": {}}},
     r"rope type 'yarn' \(full_attention layers\)"),
    ("Gemma3ForCausalLM", {"rope_local_base_freq": -5}, "rope_theta of sliding_attention"),
])
def test_bad_gemma_fields_are_refused_by_name(arch, fields, message):
    with pytest.raises(ValueError, match=message):
        config(arch, **fields)


def test_gemma_accepts_its_hub_fields():
    cfg = config("Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh",
                 hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, query_pre_attn_scalar=256, sliding_window=4096)
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.sliding_window == 4096
