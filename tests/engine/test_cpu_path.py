"""The engine's CPU fast path (C kernels, prepacked oneDNN weights) against its torch path, on
a bfloat16 model: the same first tokens, close logprobs. (Float32 runs take the C kernels too:
the Hugging Face parity tests cover them.)"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.linear import LinearBase, MergedColumnParallelLinear
from kernels import cpu_gemm, cpu_kernels, settings
from tests.checkpoints import make_checkpoint

PROMPTS = [[0, 5, 17, 99, 3, 42, 8], list(range(1, 60)), [7, 7, 7]]


def _generate(path, **kw):
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=8 << 20, block_size=16, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C compiler")
def test_bfloat16_fast_path_agrees_with_the_torch_path(tmp_path, monkeypatch):
    # Qwen2 (qkv bias), GQA 4:2, head_dim 64 (the AVX-512 decode path)
    path = make_checkpoint(tmp_path / "qwen2", arch="qwen2", hidden_size=256,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=512)
    fast, fast_out = _generate(path)
    packed = [m.packed is not None for m in fast.engine.runner.model.modules()
              if isinstance(m, LinearBase)]
    if cpu_gemm.packing_supported(torch.empty(1, 1, dtype=torch.bfloat16)):
        assert packed and all(packed)
    gate_ups = [m for m in fast.engine.runner.model.modules()
                if isinstance(m, MergedColumnParallelLinear) and m.gated_silu]
    assert len(gate_ups) == 2  # one per layer
    if cpu_gemm.pack_gated(torch.zeros(2, 32, dtype=torch.bfloat16)) is not None:
        assert all(m.activated for m in gate_ups)  # SiLU-and-multiply inside the product
    with settings.backend("reference"):
        slow, slow_out = _generate(path, cpu_packed_gemm=False)
        assert not any(m.packed is not None for m in slow.engine.runner.model.modules()
                       if isinstance(m, LinearBase))
    for f, s in zip(fast_out, slow_out, strict=True):
        assert f.token_ids[0] == s.token_ids[0]
        first = s.token_ids[0]
        assert abs(f.logprobs[0][first] - s.logprobs[0][first]) < 0.1
