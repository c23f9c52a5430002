"""The fused MoE paths (kernels/fused_moe.py): the Triton grouped GEMM and the CPU grouped_mm
path against the per-expert torch reference, with uneven expert loads (experts with no
tokens), top-1 and top-2, widths that are not multiples of the tiles; and the expert alignment
the kernel reads, exactly."""

from __future__ import annotations

import pytest
import torch

from kernels import ops, settings
from kernels.fused_moe import align_by_expert, fused_moe_cpu, fused_moe_ref, fused_moe_triton
from tests.kernels.kernel_testing import assert_close


def _problem(t: int, h: int, inter: int, e: int, k: int, dtype: torch.dtype,
             device: torch.device | str = "cpu"):
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * inter, h) * 0.2, torch.randn(e, h, inter) * 0.2
    # skewed logits: expert 0 takes most tokens, the last expert none
    logits = torch.randn(t, e) + torch.linspace(2.0, -2.0, e)
    logits[:, -1] = -1e9
    weights, ids = torch.softmax(logits, -1).topk(k, -1)
    return [a.to(device) for a in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t,h,inter,e,k", [(1, 64, 32, 4, 1), (7, 72, 40, 4, 2),
                                           (37, 64, 96, 5, 2), (100, 48, 24, 8, 1)])
def test_triton_matches_the_reference(device, dtype, t, h, inter, e, k):
    x, w13, w2, weights, ids = _problem(t, h, inter, e, k, dtype, device)
    assert int(torch.bincount(ids.flatten().cpu(), minlength=e)[-1]) == 0  # an idle expert
    got = fused_moe_triton(x, w13, w2, weights, ids)
    assert got.shape == (t, h) and got.dtype == dtype
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    if dtype == torch.float32:
        assert_close(got, want)
    else:  # h, the activations and the weighted rows are rounded to bfloat16 on the way
        scale = float(want.abs().max())
        torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=1e-2 * scale, rtol=2e-2)
    with settings.backend("triton"):
        assert_close(ops.fused_moe(x, w13, w2, weights, ids), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 2])
def test_cpu_grouped_mm_matches_the_reference(dtype, k):
    x, w13, w2, weights, ids = _problem(23, 64, 40, 6, k, dtype)
    got = fused_moe_cpu(x, w13, w2, weights, ids)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(ops.fused_moe(x, w13, w2, weights, ids), got)


def test_align_by_expert_groups_pads_and_marks_blocks():
    ids = torch.tensor([[2, 0], [0, 2], [2, 3]])  # pairs 0..5; expert 1 has none
    sorted_ids, block_expert = align_by_expert(ids, 4, 4)
    pad = 6
    assert sorted_ids.tolist() == [1, 2, pad, pad,  # expert 0: pairs 1, 2
                                   0, 3, 4, pad,  # expert 2
                                   5, pad, pad, pad,  # expert 3
                                   *[pad] * 12]  # cdiv(6, 4) + 4 = 6 blocks in all
    assert block_expert.tolist() == [0, 2, 3, -1, -1, -1]


def test_no_tokens_and_bad_shapes():
    x, w13, w2, weights, ids = _problem(3, 16, 8, 2, 1, torch.float32)
    assert fused_moe_cpu(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)
    with pytest.raises(ValueError, match="expert weights do not match"):
        fused_moe_ref(x, w13, w2[:, :, :4], weights, ids)
    with pytest.raises(ValueError, match="topk_ids and topk_weights must be"):
        fused_moe_ref(x, w13, w2, weights[:2], ids[:2])


def test_mixtral_through_the_engine_on_triton_matches_the_reference_path(device, tmp_path):
    """The tiny Mixtral with every op on Triton (the fused MoE kernel in each layer): the same
    greedy tokens as with the torch references."""
    from engine import LLM, SamplingParams
    from kernels import fused_moe
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path / "mixtral", arch="mixtral", num_hidden_layers=1)
    llm = LLM(str(path), dtype="float32", device=device.type, kv_cache_memory_bytes=8 << 20,
              block_size=8, max_num_batched_tokens=12, max_model_len=256, enforce_eager=True)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    inputs = [{"prompt_token_ids": p} for p in ([0, 647, 16, 555, 579], [0, 401, 637, 12, 13])]
    with settings.backend("reference"):
        ref = llm.generate(inputs, params, use_tqdm=False)
    calls = []
    original = fused_moe.fused_moe_triton

    def counting(*args):
        calls.append(args[0].shape[0])
        return original(*args)

    fused_moe.fused_moe_triton = counting
    try:
        with settings.backend("triton"):
            got = llm.generate(inputs, params, use_tqdm=False)
    finally:
        fused_moe.fused_moe_triton = original
    assert calls and max(calls) > 1  # prefill rows and decode rows went through the kernel
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lg in zip(r.outputs[0].logprobs, g.outputs[0].logprobs):
            (tr, vr), (tg, vg) = next(iter(lr.items())), next(iter(lg.items()))
            assert tr == tg and abs(vr - vg) < 1e-3
