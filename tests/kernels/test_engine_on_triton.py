"""The default model through the engine with every op forced to Triton (the interpreter on the
CPU, native on CUDA) gives the same greedy tokens as the reference path."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import ops

PROMPTS = [[0, 647, 16, 555, 579, 301], [0, 401, 637, 680, 596, 12, 13, 14, 15, 16, 17]]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_default_model_greedy_tokens_match_the_reference_path(device, quantization):
    """int8: the weight-only path (no oneDNN prepacking), so Triton's W8A16 matmul runs."""
    llm = LLM(None, dtype="float32", device=device.type, kv_cache_memory_bytes=8 << 20,
              block_size=8, max_num_batched_tokens=12, max_model_len=256, enforce_eager=True,
              quantization=quantization, cpu_packed_gemm=quantization is None)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    with ops.backend("reference"):  # the torch references, on CUDA too
        ref = llm.generate(inputs, params, use_tqdm=False)
    calls = {"attention": 0, "int8": 0}
    originals = (ops._attn.paged_attention_triton, ops._int8.int8_linear_triton)

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    ops._attn.paged_attention_triton = counting("attention", originals[0])
    ops._int8.int8_linear_triton = counting("int8", originals[1])
    try:
        with ops.backend("triton"):
            got = llm.generate(inputs, params, use_tqdm=False)
    finally:
        ops._attn.paged_attention_triton, ops._int8.int8_linear_triton = originals
    assert calls["attention"] > 0  # the Triton path really ran
    assert (calls["int8"] > 0) == (quantization == "int8")
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            (tr, vr), (tg, vg) = next(iter(lr.items())), next(iter(lg.items()))
            assert tr == tg and abs(vr - vg) < 1e-3
    assert torch.isfinite(llm.engine.runner.kv_cache).all()
