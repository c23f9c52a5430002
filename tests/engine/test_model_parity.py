"""Parity with Hugging Face transformers on small random checkpoints of each architecture:
the same greedy tokens for 32 new tokens, and logprobs that match HF's log-softmax."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint

NEW_TOKENS = 32
PROMPTS = [
    [0, 17, 230, 455, 12],
    [0, *range(100, 160)],
    [0, 5, 600, 601, 33, 42, 99, 7, 8, 9, 10, 11, 250, 251, 252, 253, 254],
    [3],
]

ARCHS = {
    "llama": dict(arch="llama"),
    "llama3-rope-tied": dict(arch="llama", tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(arch="qwen2"),
    "mistral": dict(arch="mistral"),
    "mistral-sliding-window": dict(arch="mistral", sliding_window=16),
    # sliding layer 0, global layer 1; attention scores and logits soft-capped. Untied: tied
    # random Gemma embeddings repeat one token.
    "gemma2": dict(arch="gemma2", attn_logit_softcapping=4.0, final_logit_softcapping=8.0,
                   tie_word_embeddings=False),
    # q/k norms; local layers' rope base 10^4, global ones 10^6 with linear scaling
    "gemma3": dict(arch="gemma3", num_hidden_layers=3, tie_word_embeddings=False, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention"], rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "qwen3": dict(arch="qwen3"),  # q/k norms, head_dim 32 (q wider than hidden_size)
    "phi3": dict(arch="phi3"),  # fused qkv_proj and gate_up_proj
    "phi4-mini-partial-rotary": dict(arch="phi3", partial_rotary_factor=0.75,
                                     tie_word_embeddings=True),
    "mixtral": dict(arch="mixtral"),  # 4 experts, top-2, renormalised
    "qwen3_moe": dict(arch="qwen3_moe"),  # q/k norms; top-2 weights not renormalised
    "qwen3_moe-norm-topk-dense-layer": dict(arch="qwen3_moe", norm_topk_prob=True,
                                            mlp_only_layers=[0]),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return make_checkpoint(path, **ARCHS[request.param])


def hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    model.generation_config.eos_token_id = None  # ignore_eos: EOS may be chosen, and go on
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                         do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(lg[0].float(), -1) for lg in out.logits]
    return tokens, logprobs


def test_greedy_tokens_and_logprobs_match_hugging_face(checkpoint):
    llm = LLM(str(checkpoint), dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens
        assert len(ref_tokens) == NEW_TOKENS and len(set(ref_tokens)) > 4  # not degenerate
        for step, (token, lp) in enumerate(zip(got.token_ids, got.logprobs)):
            assert lp[token] == pytest.approx(ref_logprobs[step][token].item(), abs=1e-4)
            top = torch.topk(ref_logprobs[step], 3)
            for ref_id, ref_lp in zip(top.indices.tolist(), top.values.tolist()):
                assert lp[ref_id] == pytest.approx(ref_lp, abs=1e-4)
