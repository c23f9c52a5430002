"""Triton rotary embedding and KV-cache store against their references."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import store_kv_cache_ref, store_kv_cache_triton
from kernels.rotary import rotary_embedding_ref, rotary_embedding_triton
from tests.kernels.kernel_testing import assert_close

HEADS = [(8, 2), (5, 1), (4, 4)]


def cos_sin_cache(max_position: int, head_size: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize("heads", HEADS)
def test_rotary_embedding_on_qkv_slices(device, heads, head_size, dtype):
    num_q, num_kv = heads
    tokens = 11
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_size).to(dtype).to(device)
    split = (num_q * head_size, (num_q + num_kv) * head_size)
    query, key = qkv[:, : split[0]], qkv[:, split[0] : split[1]]  # strided rows, as in the model
    positions = torch.randint(0, 300, (tokens,), device=device)
    cache = cos_sin_cache(300, head_size).to(device)
    q_ref, k_ref = query.clone(), key.clone()
    value_before = qkv[:, split[1] :].clone()
    rotary_embedding_triton(positions, query, key, cache, head_size)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size)
    assert_close(query, q_ref)
    assert_close(key, k_ref)
    assert torch.equal(qkv[:, split[1] :], value_before)  # V untouched


def test_rotary_int32_positions(device):
    query, key = torch.randn(5, 2 * 64, device=device), torch.randn(5, 64, device=device)
    cache = cos_sin_cache(16, 64).to(device)
    positions = torch.tensor([0, 15, 3, 3, 9], device=device)
    q_ref, k_ref = query.clone(), key.clone()
    rotary_embedding_triton(positions.int(), query, key, cache, 64)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, 64)
    assert_close(query, q_ref)
    assert_close(key, k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_store_kv_cache(device, num_kv_heads, block_size, head_size, dtype):
    num_blocks, tokens = 6, 13
    kv = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    kv_ref = kv.clone()
    key = torch.randn(tokens, num_kv_heads, head_size).to(dtype).to(device)
    value = torch.randn(tokens, num_kv_heads, head_size).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(device)
    store_kv_cache_triton(key, value, kv[:, 0], kv[:, 1], slots)
    store_kv_cache_ref(key, value, kv_ref[:, 0], kv_ref[:, 1], slots)
    assert torch.equal(kv, kv_ref)
    assert int((kv[:, 0].abs().sum(dim=(2, 3)) > 0).sum()) == tokens - 2


def test_store_kv_cache_strided_key_value(device):
    qkv = torch.randn(7, 4 * 2 * 64, device=device)
    key = qkv[:, 4 * 64 : 6 * 64].view(7, 2, 64)  # views of a fused QKV projection
    value = qkv[:, 6 * 64 :].view(7, 2, 64)
    kv = torch.zeros(3, 2, 8, 2, 64, device=device)
    kv_ref = kv.clone()
    slots = torch.tensor([0, 1, 2, 9, 10, -1, 23], device=device)
    store_kv_cache_triton(key, value, kv[:, 0], kv[:, 1], slots)
    store_kv_cache_ref(key, value, kv_ref[:, 0], kv_ref[:, 1], slots)
    assert torch.equal(kv, kv_ref)


def test_store_kv_cache_int64_offsets(device):
    """Slots whose element offsets exceed 2**31 (the cache is allocated but never touched)."""
    block_size, num_kv_heads, head_size = 16, 1, 64
    num_blocks = 2**31 // (2 * block_size * num_kv_heads * head_size) + 8
    kv = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=torch.float16, device=device)
    key = torch.randn(3, num_kv_heads, head_size).half().to(device)
    value = torch.randn(3, num_kv_heads, head_size).half().to(device)
    last = num_blocks * block_size - 1
    slots = torch.tensor([last, -1, last - block_size - 3], device=device)
    store_kv_cache_triton(key, value, kv[:, 0], kv[:, 1], slots)
    assert kv[:, 0].storage_offset() + last // block_size * kv.stride(0) > 2**31
    assert torch.equal(kv[-1, 0, -1], key[0])
    assert torch.equal(kv[-1, 1, -1], value[0])
    assert torch.equal(kv[-2, 0, block_size - 4], key[2])


def test_store_kv_cache_rejects_bad_args(device):
    kv = torch.zeros(2, 2, 8, 1, 64, device=device)
    key = torch.randn(3, 1, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv_cache_triton(key, key, kv[:, 0], kv[:, 1], torch.zeros(4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="k_cache"):
        store_kv_cache_triton(key, key, kv[:, 0, :, :, :32], kv[:, 1, :, :, :32], torch.zeros(3, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match="power of two"):
        store_kv_cache_triton(key, key, kv[:, 0, :6], kv[:, 1, :6], torch.zeros(3, dtype=torch.int64, device=device))
