"""Paged attention at the sizes a GPU serves: a 32k-token decode (split-KV, the unified kernel
and the reference agree), a decode batch of 256 sequences, NaN in every cache slot no sequence
owns, and batches padded the way CUDA graphs pad them. On CUDA (``-m gpu``) at full size; under
the CPU interpreter the same cases at sizes it runs in seconds."""

from __future__ import annotations

import torch

from kernels.paged_attention import paged_attention_ref, paged_attention_triton
from tests.kernels.kernel_testing import assert_close, build_paged_batch


def _size(device: torch.device, gpu: int, cpu: int) -> int:
    return gpu if device.type == "cuda" else cpu


def _dtype(device: torch.device) -> torch.dtype:
    # bfloat16 on a GPU (what it serves); float32 in the interpreter, whose bf16 math truncates
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def test_long_context_decode_split_unified_and_reference_agree(device):
    context = _size(device, 32768, 700)
    batch = build_paged_batch([context, context // 3 + 5, 17], [1, 1, 1], 32, 8, 128, 16,
                              _dtype(device), device)
    args = batch.attention_args(128**-0.5)
    want = paged_attention_ref(*args)
    split = paged_attention_triton(*args, split_kv=True)
    unified = paged_attention_triton(*args, split_kv=False)
    assert_close(split, want)
    assert_close(unified, want)


def test_decode_batch_of_256(device):
    n = _size(device, 256, 24)
    gen = torch.Generator().manual_seed(n)
    seq_lens = torch.randint(1, _size(device, 2048, 90), (n,), generator=gen).tolist()
    batch = build_paged_batch(seq_lens, [1] * n, 14, 2, 64, 16, _dtype(device), device)
    args = batch.attention_args(0.125)
    want = paged_attention_ref(*args)
    assert_close(paged_attention_triton(*args), want)
    assert_close(paged_attention_triton(*args, split_kv=True), want)


def _poison_unowned(batch) -> None:
    """NaN in every cache slot no sequence owns: blocks outside every table, and each last
    block's slots past its sequence."""
    bs = batch.kv.shape[2]
    owned = torch.zeros(batch.kv.shape[0], bs, dtype=torch.bool, device=batch.kv.device)
    for b, n in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[b, : -(-n // bs)].long()
        owned[blocks] = True
        owned[blocks[-1], n - (len(blocks) - 1) * bs :] = False
    batch.kv.transpose(1, 2)[~owned] = float("nan")  # [blocks, slots, k/v, heads, dims]


def test_nan_in_unowned_cache_slots_never_reaches_an_output(device):
    """Every path (prefill chunks, decode, split-KV) against the reference on the clean cache."""
    long = _size(device, 4000, 300)
    mixed = build_paged_batch([long, 37, 9, 100], [33, 1, 9, 1], 8, 2, 64, 16, _dtype(device),
                              device)
    decode = build_paged_batch([long, 37, 9, 100], [1, 1, 1, 1], 8, 2, 64, 16, _dtype(device),
                               device)
    for batch, kwargs in ((mixed, {}), (decode, {"split_kv": False}),
                          (decode, {"split_kv": True, "partition_size": 64})):
        want = paged_attention_ref(*batch.attention_args(0.125))
        _poison_unowned(batch)
        got = paged_attention_triton(*batch.attention_args(0.125), **kwargs)
        assert torch.isfinite(got).all()
        assert_close(got, want)
        batch.kv.nan_to_num_(0.0)  # the next case's reference reads a clean cache


def test_graph_padded_batch_gives_each_real_row_its_own_result(device):
    """As ``engine/executor/cuda_graphs.py`` pads a decode batch up to its bucket: extra rows of one
    query token with seq_len 1 and a block table of zeros (block 0, here NaN-filled), stale
    block ids past each real sequence's blocks, and max_seq_len the model's limit."""
    real = build_paged_batch([300, 5, 77], [1, 1, 1], 8, 2, 64, 16, _dtype(device), device,
                             first_block=1)
    want = paged_attention_ref(*real.attention_args(0.125))
    real.kv[0] = float("nan")
    pad, dev = 5, real.kv.device
    width = real.block_tables.shape[1] + 4
    tables = torch.randint(1, real.kv.shape[0], (3 + pad, width), dtype=torch.int32, device=dev)
    tables[3:] = 0
    for b, n in enumerate(real.seq_lens.tolist()):
        used = -(-n // 16)
        tables[b, :used] = real.block_tables[b, :used]
    query = torch.cat([real.query, torch.randn(pad, 8, 64, device=dev).to(real.query.dtype)])
    seq_lens = torch.cat([real.seq_lens, torch.ones(pad, dtype=torch.int32, device=dev)])
    starts = torch.arange(3 + pad + 1, dtype=torch.int32, device=dev)
    for split in (False, True):
        out = paged_attention_triton(query, real.k_cache, real.v_cache, tables, seq_lens, starts,
                                     0.125, 1, _size(device, 32768, 2048), split_kv=split)
        assert_close(out[:3], want)
