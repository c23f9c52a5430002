"""The default model through the engine with every op forced to Triton (the interpreter on the
CPU, native on CUDA) gives the same greedy tokens as the reference path."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import int8_gemm as _int8
from kernels import paged_attention as _attn
from kernels import settings

PROMPTS = [[0, 647, 16, 555, 579, 301], [0, 401, 637, 680, 596, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("quantization,kv_cache_dtype",
                         [(None, "auto"), ("int8", "auto"), (None, "fp8")])
def test_default_model_greedy_tokens_match_the_reference_path(device, quantization,
                                                              kv_cache_dtype):
    """int8: the weight-only path (no oneDNN prepacking), so Triton's W8A16 matmul runs; fp8:
    Triton's fp8 store and attention against the reference's (a GPU needs sm_89+)."""
    if (kv_cache_dtype == "fp8" and device.type == "cuda"
            and torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("fp8 KV cache needs compute capability 8.9+")
    llm = LLM(None, dtype="float32", device=device.type, kv_cache_memory_bytes=8 << 20,
              block_size=8, max_num_batched_tokens=12, max_model_len=256, enforce_eager=True,
              quantization=quantization, cpu_packed_gemm=quantization is None,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    with settings.backend("reference"):  # the torch references, on CUDA too
        ref = llm.generate(inputs, params, use_tqdm=False)
    calls = {"attention": 0, "int8": 0}
    originals = (_attn.paged_attention_triton, _int8.int8_linear_triton)

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    _attn.paged_attention_triton = counting("attention", originals[0])
    _int8.int8_linear_triton = counting("int8", originals[1])
    try:
        with settings.backend("triton"):
            got = llm.generate(inputs, params, use_tqdm=False)
    finally:
        _attn.paged_attention_triton, _int8.int8_linear_triton = originals
    assert calls["attention"] > 0  # the Triton path really ran
    assert (calls["int8"] > 0) == (quantization == "int8")
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            (tr, vr), (tg, vg) = next(iter(lr.items())), next(iter(lg.items()))
            assert tr == tg and abs(vr - vg) < 1e-3
    assert torch.isfinite(llm.engine.runner.kv_cache.float()).all()


def test_gemma2_sliding_window_and_softcap_match_the_reference_path(device, tmp_path):
    """Gemma 2 (window 12 on layer 0, soft-capped scores and logits) through the Triton
    attention: the prompts, chunked by 12 tokens, and their decode steps cross the window."""
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "gemma2", arch="gemma2", attn_logit_softcapping=4.0,
                           final_logit_softcapping=8.0, tie_word_embeddings=False)
    llm = LLM(str(path), dtype="float32", device=device.type, kv_cache_memory_bytes=8 << 20,
              block_size=8, max_num_batched_tokens=12, max_model_len=256, enforce_eager=True)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in [[0, *range(100, 130)], PROMPTS[1]]]
    with settings.backend("reference"):
        ref = llm.generate(inputs, params, use_tqdm=False)
    with settings.backend("triton"):
        got = llm.generate(inputs, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            (tr, vr), (tg, vg) = next(iter(lr.items())), next(iter(lg.items()))
            assert tr == tg and abs(vr - vg) < 1e-4
