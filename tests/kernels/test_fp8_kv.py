"""The fp8 E4M3 KV cache: the store's conversion (C and Triton bit-identical to torch's) and
every attention path (C kernel, Triton, torch reference) reading fp8 caches."""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from kernels import cpu_launchers as cpu
from kernels.kv_cache import (
    FP8_KV_DTYPE,
    store_kv_cache_ref,
    store_kv_cache_triton,
    to_cache_dtype,
)
from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from tests.kernels.kernel_testing import assert_close, build_paged_batch

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                              reason="no C compiler: the CPU kernels fall back to torch")
# Edge values: saturation (448 is the largest finite value, infinities saturate too), NaN,
# subnormals (steps of 2^-9) and the rounding ties between them, ties between normal values.
EDGES = [float("inf"), -float("inf"), 464.0, 448.5, 447.0, -1000.0, float("nan"), 2.0**-10,
         3 * 2.0**-11, -1.5 * 2.0**-9, 2.0**-7 + 2.0**-10, 1.0625, 1.1875, 2.0**-6 - 2.0**-11,
         0.0, -0.0]


def _keys(dtype: torch.dtype, tokens: int = 40, heads: int = 2, head_size: int = 64):
    torch.manual_seed(tokens)
    key = torch.randn(tokens, heads, head_size) * torch.logspace(-4, 3, tokens)[:, None, None]
    key[0, 0, : len(EDGES)] = torch.tensor(EDGES)
    value = torch.randn(tokens, heads, head_size)
    return key.to(dtype), value.to(dtype)


def _fp8_caches(heads: int = 2, head_size: int = 64, device: str = "cpu"):
    return [torch.zeros(8, 16, heads, head_size, dtype=FP8_KV_DTYPE, device=device)
            for _ in range(2)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


def test_the_conversion_rounds_to_nearest_and_saturates_at_448():
    x = torch.tensor([500.0, -1e9, float("inf"), 448.0, 1.0625, 1.1875, 2.0**-10, 1e-4])
    got = to_cache_dtype(x, FP8_KV_DTYPE).float()
    assert got.tolist() == [448.0, -448.0, 448.0, 448.0, 1.0, 1.25, 0.0, 0.0]
    # normal values keep 3 mantissa bits: within half a step (1/16) of themselves
    y = torch.linspace(-400, 400, 10001)
    y = y[y.abs() > 2.0**-6]
    assert ((to_cache_dtype(y, FP8_KV_DTYPE).float() - y).abs() <= y.abs() / 16).all()
    # the scale divides before the conversion
    assert to_cache_dtype(torch.tensor([3.0]), FP8_KV_DTYPE, scale=2.0).float().item() == 1.5


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.0)])
def test_c_store_has_torchs_fp8_bits(dtype, scales):
    key, value = _keys(dtype)
    slots = torch.randperm(128)[:40]
    slots[5] = -1
    got, want = _fp8_caches(), _fp8_caches()
    assert cpu.supports_store(key, value, *got, slots)
    cpu.store_kv_cache(key, value, *got, slots, *scales)
    store_kv_cache_ref(key, value, *want, slots, *scales)
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))
    assert _bits(got[0]).any()  # something was written
    kept = slots[slots >= 0]
    assert not _bits(got[0]).flatten(0, 1)[[s for s in range(128) if s not in kept]].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_store_has_torchs_fp8_bits(device, dtype):
    key, value = (t.to(device) for t in _keys(dtype))
    slots = torch.randperm(128)[:40].to(device)
    slots[3] = -1
    got, want = _fp8_caches(device=device), _fp8_caches(device=device)
    store_kv_cache_triton(key, value, *got, slots, 0.5, 1.0)
    store_kv_cache_ref(key, value, *want, slots, 0.5, 1.0)
    assert want[0].float().isnan().any()  # the NaN edge key was stored
    assert torch.equal(_bits(got[0]), _bits(want[0])) and torch.equal(_bits(got[1]), _bits(want[1]))


def _fp8_batch(query_dtype, heads, head_size, block_size, device="cpu",
               seq_lens=(37, 5, 70, 200, 1, 130), query_lens=(37, 1, 9, 1, 1, 24)):
    torch.manual_seed(head_size + block_size)
    batch = build_paged_batch(list(seq_lens), list(query_lens), *heads, head_size=head_size,
                              block_size=block_size, dtype=torch.float32, device=device)
    return dataclasses.replace(batch, kv=batch.kv.to(FP8_KV_DTYPE).contiguous(),
                               query=batch.query.to(query_dtype))


def _upcast_reference(batch, scale):
    """The same attention over the fp8 cache's values held in the query's dtype."""
    upcast = dataclasses.replace(batch, kv=batch.kv.to(batch.query.dtype))
    return paged_attention_ref(*upcast.attention_args(scale))


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads,head_size", [((14, 2), 64), ((8, 2), 128), ((4, 1), 80),
                                             ((6, 2), 32), ((4, 2), 36)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_c_attention_reads_fp8_caches(dtype, heads, head_size, block_size):
    batch = _fp8_batch(dtype, heads, head_size, block_size)
    args = (batch.query, batch.k_cache.contiguous(), batch.v_cache.contiguous(),
            batch.block_tables, batch.seq_lens, batch.query_start_loc)
    assert cpu.supports_attention(*args)
    got = cpu.paged_attention(*args, 0.125)
    want = paged_attention_ref(*batch.attention_args(0.125))
    assert got.dtype == dtype
    tol = dict(atol=3e-5, rtol=3e-5) if dtype == torch.float32 else dict(atol=2.5e-2, rtol=2.5e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(got.float(), _upcast_reference(batch, 0.125).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("split_kv", [False, True])
def test_triton_attention_reads_fp8_caches(device, dtype, split_kv):
    batch = _fp8_batch(dtype, (8, 2), 64, 16, device)
    if split_kv:  # decode-only batch, forced into small partitions
        batch = _fp8_batch(dtype, (8, 2), 64, 16, device, [150, 7, 65, 32], [1, 1, 1, 1])
    kwargs = dict(split_kv=True, partition_size=32) if split_kv else {}
    got = paged_attention_triton(*batch.attention_args(0.125), **kwargs)
    assert_close(got, paged_attention_ref(*batch.attention_args(0.125)))
    assert_close(got, _upcast_reference(batch, 0.125))
