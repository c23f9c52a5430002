"""LongRoPE (Phi-3 "longrope", older "su") against Hugging Face: the cos/sin tables for both
factor lists, and greedy generation under pagedserve's rule (``engine.layers.rotary``): the
long factors for every position when max_model_len exceeds original_max_position_embeddings,
the short factors when it does not."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.hf_config import HFConfig
from engine.models.llama import rotary_embedding
from tests.checkpoints import make_checkpoint

OLD_LEN = 32  # original_max_position_embeddings; max_position_embeddings is 512
SHORT = [1.0, 1.05, 1.1, 1.2, 1.35, 1.5]  # 6: half of the 12 rotary dims (16 * 0.75)
LONG = [1.0, 1.5, 3.0, 6.0, 12.0, 24.0]
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
        "long_factor": LONG}
MSCALE = (1 + torch.log(torch.tensor(512 / OLD_LEN)) / torch.log(torch.tensor(OLD_LEN))) ** 0.5
PROMPTS = [[0, 17, 230, 455, 12], [0, *range(100, 160)], [3]]  # 5, 61 and 1 tokens
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8)


def phi3_config(**changes) -> dict:
    from transformers import Phi3Config

    cfg = Phi3Config(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     original_max_position_embeddings=OLD_LEN, partial_rotary_factor=0.75,
                     rope_parameters=dict(ROPE), pad_token_id=None)
    return cfg.to_dict() | {"architectures": ["Phi3ForCausalLM"]} | changes


def with_rope(**change) -> dict:
    raw = phi3_config()
    raw["rope_parameters"] = dict(raw["rope_parameters"], **change)
    return raw


def our_table(raw: dict, max_model_len: int) -> torch.Tensor:
    hf = HFConfig.from_dict(raw)
    hf.max_model_len = max_model_len
    return rotary_embedding(hf).cos_sin_cache


def test_tables_match_hugging_face_below_and_above_original_length():
    """HF's table for a call whose positions stay within 32 (short factors) and for one that
    reaches past it (long factors), both scaled by sqrt(1 + log(16) / log(32)); ours with
    max_model_len 32 and 512."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    raw = phi3_config()
    hf_rope = Phi3RotaryEmbedding(Phi3Config.from_dict(raw))
    x = torch.zeros(1, dtype=torch.float32)
    for seq_len, max_model_len in ((OLD_LEN, OLD_LEN), (200, 512), (OLD_LEN, OLD_LEN)):
        cos, sin = hf_rope(x, torch.arange(seq_len)[None])
        table = our_table(raw, max_model_len)[:seq_len]
        assert table.shape == (seq_len, 12)
        torch.testing.assert_close(table[:, :6], cos[0, :, :6], atol=1e-5, rtol=0)  # HF: float32 angles
        torch.testing.assert_close(table[:, 6:], sin[0, :, :6], atol=1e-5, rtol=0)  # HF: float32 angles
    factors = LONG if max_model_len > OLD_LEN else SHORT
    assert float(table[1, 5]) == pytest.approx(float(MSCALE) * torch.cos(
        torch.tensor(1 / (factors[5] * 10000 ** (10 / 12)), dtype=torch.float64)).item())


def test_su_is_longrope_and_original_length_is_read_at_top_level():
    raw = phi3_config(rope_parameters=None,
                      rope_scaling={"type": "su", "short_factor": SHORT, "long_factor": LONG})
    for max_model_len in (OLD_LEN, 512):
        assert torch.equal(our_table(raw, max_model_len), our_table(phi3_config(), max_model_len))
    assert not torch.equal(our_table(raw, OLD_LEN), our_table(raw, OLD_LEN + 1))


@pytest.mark.parametrize(("change", "message"), [
    ({"short_factor": SHORT[:5]}, "rope short_factor must be a list of 6 positive numbers"),
    ({"long_factor": [1.0] * 5 + ["x"]}, "rope long_factor must be a list of 6"),
    ({"attention_factor": -1.0}, "rope attention_factor must be a positive number"),
])
def test_malformed_longrope_is_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        HFConfig.from_dict(with_rope(**change))


def test_partial_rotary_factor_and_original_length_are_checked():
    with pytest.raises(ValueError, match=r"partial_rotary_factor must be a number in \(0, 1\]"):
        HFConfig.from_dict(with_rope(partial_rotary_factor=1.5))
    with pytest.raises(ValueError, match="rotates 5 of head_dim=16 dimensions; it must be an "
                                         "even number"):
        HFConfig.from_dict(with_rope(partial_rotary_factor=0.3125))
    raw = with_rope()
    del raw["original_max_position_embeddings"], raw["rope_parameters"][
        "original_max_position_embeddings"]
    with pytest.raises(ValueError, match="LongRoPE needs original_max_position_embeddings"):
        HFConfig.from_dict(raw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("phi3-longrope"), arch="phi3",
                           original_max_position_embeddings=OLD_LEN, partial_rotary_factor=0.75,
                           rope_parameters=dict(ROPE))


def hf_model(path, factors: list[float] | None = None):
    """HF's model; ``factors``: both lists replaced by it (HF then uses it at every length)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if factors is not None:
        config.rope_parameters = dict(config.rope_parameters, short_factor=factors,
                                      long_factor=factors)
    return AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.log_softmax(
        torch.stack(out.logits)[:, 0].float(), -1)


def assert_matches(outs, refs) -> None:
    for out, (tokens, logprobs) in zip(outs, refs, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens
        assert len(set(tokens)) > 4  # not degenerate
        for step, token in enumerate(tokens):
            assert got.logprobs[step][token] == pytest.approx(logprobs[step, token].item(),
                                                              abs=1e-4)


def test_long_factors_everywhere_when_max_model_len_exceeds_original(checkpoint):
    """max_model_len 512 > 32: every position rotated with the long factors, also those of a
    5-token prompt before its generation crosses 32 (HF with both lists set to the long one);
    a 61-token prompt, whose every HF forward is past 32, matches HF unchanged too."""
    llm = LLM(str(checkpoint), **ENGINE)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    long_everywhere = hf_model(checkpoint, LONG)
    assert_matches(outs, [hf_greedy(long_everywhere, p, 32) for p in PROMPTS])
    assert_matches(outs[1:2], [hf_greedy(hf_model(checkpoint), PROMPTS[1], 32)])
    # HF's own rule rotates the 5-token prompt's first 32 positions with the short factors
    assert hf_greedy(hf_model(checkpoint), PROMPTS[0], 32)[0] != outs[0].outputs[0].token_ids


def test_short_factors_when_max_model_len_is_within_original(checkpoint):
    """max_model_len 32: the short factors, as HF uses them for sequences of up to 32."""
    llm = LLM(str(checkpoint), max_model_len=OLD_LEN, **ENGINE)
    prompts = [PROMPTS[0], PROMPTS[2]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=OLD_LEN - len(p), temperature=0.0,
                                        ignore_eos=True, logprobs=1) for p in prompts],
                        use_tqdm=False)
    hf = hf_model(checkpoint)
    assert_matches(outs, [hf_greedy(hf, p, OLD_LEN - len(p)) for p in prompts])
    assert json.loads((checkpoint / "config.json").read_text())[
        "original_max_position_embeddings"] == OLD_LEN
