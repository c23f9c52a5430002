"""Shared helpers for the kernel tests: tolerances and a paged-batch builder."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    # The interpreter truncates fp32 -> bf16 instead of rounding to nearest: allow ~2 bf16 ulps.
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Kernel vs reference, compared on the CPU with the tolerance of expected's dtype."""
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **TOLERANCES[expected.dtype])


@dataclass
class PagedBatch:
    """A flat batch over a paged cache, plus the dense K/V each sequence's cache holds."""

    query: torch.Tensor  # [T, Hq, D]
    kv: torch.Tensor  # [num_blocks, 2, block_size, Hk, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    dense_k: list[torch.Tensor]  # per sequence [seq_len, Hk, D]
    dense_v: list[torch.Tensor]
    max_query_len: int
    max_seq_len: int

    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv[:, 0]

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv[:, 1]

    def attention_args(self, scale: float) -> tuple:
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, scale, self.max_query_len, self.max_seq_len)


def build_paged_batch(
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
    first_block: int = 0,
) -> PagedBatch:
    """Random K/V written block by block into shuffled cache blocks (ids >= first_block).

    Cache blocks that no sequence owns are left uninitialised (NaN-free random on small caches);
    block-table entries past a sequence's blocks are -1, as the engine pads them.
    """
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    needed = sum(blocks_per_seq)
    num_blocks = num_blocks or first_block + needed + 3
    ids = (first_block + torch.randperm(num_blocks - first_block)[:needed]).tolist()
    if num_blocks * block_size * num_kv_heads * head_size <= 2**24:
        kv = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_size).to(dtype)
        kv = kv.to(device)
    else:  # huge cache: allocate lazily, touch only the blocks in use
        kv = torch.empty(num_blocks, 2, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
        # The references gather block 0 for -1 table entries and mask it out; uninitialised
        # memory (recycled when glibc keeps freed memory, see engine/executor/cpu_runtime.py) can hold
        # NaN, which a zero softmax weight does not cancel.
        kv[0].zero_()
    table = torch.full((len(seq_lens), max(blocks_per_seq) + 1), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, n_blocks in enumerate(blocks_per_seq):
        mine = ids[:n_blocks]
        ids = ids[n_blocks:]
        table[b, :n_blocks] = torch.tensor(mine, dtype=torch.int32)
        fresh = torch.randn(n_blocks, 2, block_size, num_kv_heads, head_size).to(dtype).to(device)
        kv[mine] = fresh
        dense_k.append(fresh[:, 0].flatten(0, 1)[: seq_lens[b]])
        dense_v.append(fresh[:, 1].flatten(0, 1)[: seq_lens[b]])
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    query = torch.randn(starts[-1], num_q_heads, head_size).to(dtype).to(device)
    return PagedBatch(
        query=query,
        kv=kv,
        block_tables=table.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        dense_k=dense_k,
        dense_v=dense_v,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
