"""Triton paged attention (unified mixed-batch kernel and split-KV) against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from kernels.paged_attention_split import split_pays
from tests.kernels.kernel_testing import assert_close, build_paged_batch

HEADS = [(8, 2), (5, 1), (4, 4)]
HEAD_SIZES = [64, 80, 96, 128]
BLOCK_SIZES = [8, 16, 128]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (seq_lens, query_lens): context lengths are not multiples of the block size.
SCENARIOS = {
    "prefill": ([23, 41], [23, 41]),
    "prefix_cached_chunks": ([45, 70], [13, 30]),
    "decode": ([1, 37, 130, 9], [1, 1, 1, 1]),
    "mixed": ([37, 5, 16, 50, 70], [37, 1, 4, 1, 9]),
}


def check(batch, **kwargs):
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention_triton(*batch.attention_args(scale), **kwargs)
    assert out.shape == batch.query.shape
    assert_close(out, paged_attention_ref(*batch.attention_args(scale)))
    return out


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_batch_shapes(device, heads, head_size, block_size):
    seq_lens, query_lens = SCENARIOS["mixed"]
    check(build_paged_batch(seq_lens, query_lens, *heads, head_size, block_size, torch.float16, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenarios_and_dtypes(device, scenario, dtype):
    seq_lens, query_lens = SCENARIOS[scenario]
    check(build_paged_batch(seq_lens, query_lens, 8, 2, 64, 16, dtype, device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_split_kv(device, heads, dtype):
    """Forced split-KV with small partitions: 1 to 5 partitions per sequence, some empty."""
    batch = build_paged_batch([150, 7, 65, 32], [1, 1, 1, 1], *heads, 80, 16, dtype, device)
    check(batch, split_kv=True, partition_size=32)


def test_split_kv_chunks_follow_each_sequences_length(device):
    """A split count sized for a long context (as under CUDA graphs, from max_model_len) on
    short sequences: each sequence cuts its own length into that many chunks, every chunk a
    multiple of the 32-key tile (so most are empty here), and the result is still exact."""
    batch = build_paged_batch([150, 7, 65, 33], [1, 1, 1, 1], 8, 2, 64, 16, torch.float32, device)
    args = list(batch.attention_args(64**-0.5))
    args[-1] = 8192  # max_seq_len: 16 splits of 512, more than any sequence here fills
    out = paged_attention_triton(*args, split_kv=True)
    assert_close(out, paged_attention_ref(*batch.attention_args(64**-0.5)))


def test_split_kv_matches_unified_kernel(device):
    batch = build_paged_batch([300, 77], [1, 1], 8, 2, 128, 8, torch.float32, device)
    split = check(batch, split_kv=True, partition_size=64)
    torch.testing.assert_close(split, paged_attention_triton(*batch.attention_args(128**-0.5), split_kv=False))


def test_split_heuristic():
    cuda_like = torch.device("cpu")  # the interpreter behaves like a 132-SM GPU
    assert split_pays(cuda_like, num_seqs=4, num_kv_heads=8, max_seq_len=8192)
    assert not split_pays(cuda_like, num_seqs=64, num_kv_heads=8, max_seq_len=8192)  # grid is full
    assert not split_pays(cuda_like, num_seqs=4, num_kv_heads=8, max_seq_len=600)  # short context


def test_split_kv_needs_decode_only_batch(device):
    batch = build_paged_batch([20, 9], [4, 1], 4, 4, 64, 8, torch.float32, device)
    with pytest.raises(ValueError, match="decode-only"):
        paged_attention_triton(*batch.attention_args(1.0), split_kv=True)


def test_long_decode_takes_split_path_by_default(device):
    batch = build_paged_batch([1100, 1500], [1, 1], 4, 1, 64, 128, torch.float16, device)
    check(batch)  # 2 seqs x 1 kv head, max_seq_len >= 1024: split_pays() picks split-KV


def test_int64_cache_offsets(device):
    """Blocks whose element offsets exceed 2**31; the cache is allocated but mostly untouched."""
    block_size, num_kv_heads, head_size = 16, 1, 64
    num_blocks = 2**31 // (2 * block_size * num_kv_heads * head_size) + 16
    batch = build_paged_batch([40, 17, 1], [5, 1, 1], 4, num_kv_heads, head_size, block_size,
                              torch.float16, device, num_blocks=num_blocks, first_block=num_blocks - 10)
    assert int(batch.block_tables.max()) * batch.kv.stride(0) > 2**31
    check(batch)
    decode = build_paged_batch([40, 17], [1, 1], 4, num_kv_heads, head_size, block_size,
                               torch.float16, device, num_blocks=num_blocks, first_block=num_blocks - 10)
    check(decode, split_kv=True, partition_size=32)


def test_padding_tokens_give_zero_rows(device):
    batch = build_paged_batch([6, 4], [3, 1], 4, 2, 64, 8, torch.float32, device)
    query = torch.cat([batch.query, torch.randn(3, 4, 64, device=device)])
    args = list(batch.attention_args(0.125))
    args[0] = query
    out = paged_attention_triton(*args)
    assert torch.equal(out[4:].cpu(), torch.zeros(3, 4, 64))
    assert_close(out, paged_attention_ref(*args))


def test_rejects_bad_arguments(device):
    batch = build_paged_batch([6], [6], 4, 2, 64, 8, torch.float32, device)
    args = list(batch.attention_args(1.0))
    bad_heads = list(args)
    bad_heads[0] = torch.randn(6, 3, 64, device=device)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_triton(*bad_heads)
    bad_dtype = list(args)
    bad_dtype[0] = batch.query.half()
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_triton(*bad_dtype)
    bad_loc = list(args)
    bad_loc[5] = batch.query_start_loc[:1]
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_attention_triton(*bad_loc)


# Sliding window (keys at positions > p - window) and soft-capped scores (Gemma 2): windows
# shorter than a block, across block and 32-key tile boundaries, and longer than some contexts.
WINDOWS = [5, 16, 40]


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=lambda c: f"cap{c:g}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sliding_window_and_softcap(device, scenario, window, softcap):
    seq_lens, query_lens = SCENARIOS[scenario]
    batch = build_paged_batch(seq_lens, query_lens, 8, 2, 64, 8, torch.float32, device)
    args = batch.attention_args(0.3)
    out = paged_attention_triton(*args, sliding_window=window, softcap=softcap)
    want = paged_attention_ref(*args, window, softcap)
    assert_close(out, want)
    assert not torch.allclose(want, paged_attention_ref(*args))  # the window or cap mattered


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [7, 33, 1000], ids=lambda w: f"w{w}")
def test_split_kv_sliding_window_and_softcap(device, window, dtype):
    """Split-KV cuts only the window's keys into the splits (1000: wider than every context)."""
    batch = build_paged_batch([150, 7, 65, 32], [1, 1, 1, 1], 5, 1, 80, 16, dtype, device)
    args = batch.attention_args(80**-0.5)
    out = paged_attention_triton(*args, split_kv=True, partition_size=32,
                                 sliding_window=window, softcap=2.0)
    assert_close(out, paged_attention_ref(*args, window, 2.0))


def test_rejects_negative_window(device):
    batch = build_paged_batch([6], [6], 4, 2, 64, 8, torch.float32, device)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention_triton(*batch.attention_args(1.0), sliding_window=-1)
