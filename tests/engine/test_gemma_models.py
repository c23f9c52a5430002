"""Gemma specifics beyond the parity suite: tied embeddings by default (Hub configs of Gemma 2
often leave ``tie_word_embeddings`` out, and their checkpoints hold no ``lm_head.weight``)."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from tests.checkpoints import make_checkpoint
from tests.engine.test_model_parity import hf_greedy


def test_gemma2_ties_embeddings_when_config_json_is_silent(tmp_path):
    path = make_checkpoint(tmp_path / "g2", arch="gemma2", attn_logit_softcapping=4.0,
                           final_logit_softcapping=8.0)
    config = json.loads((path / "config.json").read_text())
    del config["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8)
    assert llm.engine.runner.model.cfg.tie_word_embeddings
    prompt = [0, *range(300, 330)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    tokens, logprobs = hf_greedy(hf, prompt)
    assert got.token_ids == tokens[:8]
    for step, lp in enumerate(got.logprobs):
        top = torch.topk(logprobs[step], 3)
        for ref_id, ref_lp in zip(top.indices.tolist(), top.values.tolist()):
            assert lp[ref_id] == pytest.approx(ref_lp, abs=1e-4)
