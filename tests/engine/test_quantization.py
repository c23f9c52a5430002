"""``quantization="int8"``: weights quantized at load time, on each parity architecture.

Quality against the same engine in float32, teacher-forced on the float32 engine's greedy
continuation of each prompt:

- The mean KL divergence of the next-token distributions under ``MEAN_KL`` nats. bfloat16
  weights and activations give about 0.0006 nats on these models; int8 weights alone (the
  reference path) about 0.0015 and with activations quantized per token (the CPU path) about
  0.0035. 0.01 nats, a likelihood ratio of 1% per token on average, leaves room for the seed
  and still fails a wrong scale or zero point by orders of magnitude.
- Greedy choices: these random models' next-token distributions are nearly flat (entropy 5.4
  nats of at most 6.6), so many positions are near-ties that any change of rounding flips (the
  largest top-1/top-2 gap int8 flipped: 0.16 nats). Wherever float32's top token leads by more
  than ``MARGIN`` nats, int8 picks the same token; and int8's own greedy generation gives the
  same tokens up to each prompt's first near-tie.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor.model_runner import weight_bytes
from engine.layers.context import AttentionMetadata, set_context
from engine.layers.linear import LinearBase
from kernels import cpu_kernels
from tests.checkpoints import make_checkpoint
from tests.engine.test_model_parity import ARCHS, PROMPTS

NEW_TOKENS = 16
MEAN_KL = 0.01
# An fp8 E4M3 cache rounds every key and value to 3 mantissa bits (up to 1/16 relative error,
# against int8 weights' 1/254 of a row's largest value): the mean KL measured 0.011-0.014
# nats alone and 0.016-0.019 with int8 weights, and near-ties up to 0.42 nats (0.81 with int8
# weights) flip. 0.03 nats and margins of 0.5 (1.0) still fail a lost scale or a misread byte
# by orders of magnitude; 16 (4) clear positions of 64 remain to check at those margins.
FP8_KV = dict(mean_kl=0.03, margin=0.5, min_clear=16)
FP8_KV_INT8 = dict(mean_kl=0.03, margin=1.0, min_clear=4)
MARGIN = 0.3
COMMON = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


# One checkpoint of each quantized model class and attention variant. Left out: the
# mixture-of-experts models (they refuse quantization: tests/engine/test_moe.py); gemma2,
# whose final soft-cap (tanh at 8) squeezes the logits so that too few positions are clear of
# near-ties for the greedy check to say anything (9-17 of the 16-32 required; gemma3 covers
# the Gemma class); phi3 and phi4-mini, whose random checkpoints have the same problem under
# FP8 weights (1-3 clear positions of the 4 required) and whose fp8 KV cache gives the same
# mean KL as the others (0.016-0.017 nats) with one 1.1-nat flip (phi4-mini); their linear
# layers are the Llama ones once loaded (tests/engine/test_phi3_qwen3_loading.py).
QUANTIZABLE = ["llama", "llama3-rope-tied", "mistral", "mistral-sliding-window", "qwen2", "qwen3",
               "gemma3"]


@pytest.fixture(scope="module", params=QUANTIZABLE)
def float_run(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), **ARCHS[request.param])
    llm = LLM(str(path), **COMMON)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return path, llm, [o.outputs[0].token_ids for o in outs]


def next_token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-softmax of the logits after every position of ``ids`` (one prefill, cache empty)."""
    runner = llm.engine.runner
    n = len(ids)
    blocks = -(-n // runner.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), max_query_len=n, max_seq_len=n)
    with torch.inference_mode(), set_context(meta):
        logits = runner.model.compute_logits(runner.model(torch.tensor(ids), torch.arange(n)))
    assert logits is not None
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("packed", [True, False], ids=["c-int8", "weight-only-reference"])
def test_int8_greedy_tokens_and_kl_close_to_float(float_run, packed):
    path, ref_llm, ref_tokens = float_run
    llm = LLM(str(path), quantization="int8", cpu_packed_gemm=packed, **COMMON)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quantization == "int8" for m in linears)
    if packed and cpu_kernels.available():
        assert all(m.int8 is not None and m.weight.numel() == 0 for m in linears)
    else:
        assert all(m.int8 is None and m.weight.dtype == torch.int8 for m in linears)
    model = llm.engine.runner.model
    assert model.model.embed_tokens.weight.dtype == torch.int8  # looked up, then scaled
    assert model.lm_head.weight_scale is not None
    assert (model.lm_head.int8 is not None) == (packed and cpu_kernels.available())
    assert_close_to_float(ref_llm, ref_tokens, llm)


def test_int8_bfloat16_activations(float_run):
    """bfloat16 activations round every layer's input to 8 bits of mantissa besides the int8
    steps: on qwen2 the mean KL is 0.0043 nats and a near-tie of 0.34 nats flips (with
    oneDNN's int8 product, which rounded to bfloat16 before the row scale: 0.0049 and 0.23), so
    the margin here is 0.45 nats (on llama 27 of the 64 positions are that clear: 16 must be)."""
    path, ref_llm, ref_tokens = float_run
    llm = LLM(str(path), quantization="int8", **{**COMMON, "dtype": "bfloat16"})
    assert_close_to_float(ref_llm, ref_tokens, llm, margin=0.45, min_clear=16)


def assert_close_to_float(ref_llm: LLM, ref_tokens: list[list[int]], llm: LLM,
                          mean_kl: float = MEAN_KL, margin: float = MARGIN,
                          min_clear: int = len(PROMPTS) * NEW_TOKENS // 2) -> None:
    """The checks of the module's docstring, for ``llm`` against the float32 ``ref_llm``."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    kls, clear_total = [], 0
    for prompt, want, out in zip(PROMPTS, ref_tokens, outs):
        ids = prompt + want
        p = next_token_logprobs(ref_llm, ids)[len(prompt) - 1:-1]  # before each new token
        q = next_token_logprobs(llm, ids)[len(prompt) - 1:-1]
        assert p.argmax(-1).tolist() == want
        kls.append((p.exp() * (p - q)).sum(-1))
        top2 = p.topk(2, dim=-1).values
        clear = top2[:, 0] - top2[:, 1] > margin
        assert torch.equal(q.argmax(-1)[clear], p.argmax(-1)[clear])
        clear_total += int(clear.sum())
        first_tie = int((~clear).nonzero()[0]) if not clear.all() else NEW_TOKENS
        assert out.outputs[0].token_ids[:first_tie] == want[:first_tie]
    assert clear_total >= min_clear  # the check above is not vacuous
    kl = torch.cat(kls)
    assert 0 < kl.mean().item() < mean_kl  # and not the float model itself


def test_weight_bytes_halved_against_bfloat16(float_run):
    """Every weight as stored (linear layers, embedding, LM head, norms), unpacked."""
    path = float_run[0]
    common = {**COMMON, "dtype": "bfloat16", "cpu_packed_gemm": False}
    bf16 = weight_bytes(LLM(str(path), **common).engine.runner.model)
    int8 = weight_bytes(LLM(str(path), quantization="int8", **common).engine.runner.model)
    # int8 values, and 4 bytes of scale per row of 64 (these models' hidden size): 0.53
    assert 0.5 < int8 / bf16 < 0.56


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization"):
        LLM(None, quantization="int4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kv_cache_greedy_tokens_and_kl_close_to_float(float_run, dtype):
    """``kv_cache_dtype="fp8"``: keys and values stored as fp8 E4M3 and read back by the C
    kernel, within the bounds of ``FP8_KV``."""
    path, ref_llm, ref_tokens = float_run
    llm = LLM(str(path), kv_cache_dtype="fp8", **{**COMMON, "dtype": dtype})
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert llm.engine.kv_cache_dtype == "fp8_e4m3"
    assert_close_to_float(ref_llm, ref_tokens, llm, **FP8_KV)


def test_fp8_kv_cache_with_int8_weights(float_run):
    path, ref_llm, ref_tokens = float_run
    llm = LLM(str(path), kv_cache_dtype="fp8_e4m3", quantization="int8", **COMMON)
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert_close_to_float(ref_llm, ref_tokens, llm, **FP8_KV_INT8)


def test_fp8_kv_cache_holds_twice_bfloat16s_blocks(float_run):
    path = float_run[0]
    blocks = {kv: LLM(str(path), kv_cache_dtype=kv, **{**COMMON, "dtype": "bfloat16"})
              .engine.runner.num_blocks for kv in ("auto", "fp8")}
    # the same budget over blocks half the size: twice as many, or one more where the budget
    # leaves half a bfloat16 block over
    assert blocks["fp8"] - 2 * blocks["auto"] in (0, 1)
    f32 = LLM(str(path), **COMMON).engine.runner.num_blocks
    assert blocks["fp8"] - 4 * f32 in (0, 1, 2, 3)


def test_fp8_kv_cache_setting_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(None, kv_cache_dtype="fp8_e5m2")


# FP8 E4M3 weights: 3 mantissa bits, the bounds of FP8 checkpoints (test_checkpoint_quant.py)
FP8_WEIGHTS = dict(mean_kl=0.1, margin=1.2, min_clear=4)


@pytest.mark.parametrize("packed", [True, False], ids=["requantized-int8", "fp8-reference"])
def test_fp8_weights_greedy_tokens_and_kl_close_to_float(float_run, packed):
    """``quantization="fp8"``: the linear layers' weights FP8 per channel (the embedding and LM
    head left in dtype); on the CPU oneDNN runs them requantized to int8, else the weight-only
    FP8 reference."""
    path, ref_llm, ref_tokens = float_run
    llm = LLM(str(path), quantization="fp8", cpu_packed_gemm=packed, **COMMON)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.quantization == "fp8" for m in linears)
    if packed and cpu_kernels.available():
        assert all(m.int8 is not None and m.weight.numel() == 0 for m in linears)
    else:
        assert all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert model.model.embed_tokens.weight_scale is None and model.lm_head.weight_scale is None
    assert llm.engine.quantization == "fp8"
    assert_close_to_float(ref_llm, ref_tokens, llm, **FP8_WEIGHTS)
