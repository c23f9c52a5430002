"""CUDA graphs for decode steps (GPU only).

A decode-only batch (one new token per sequence) has the same shapes step after step, so the
forward pass is captured once per bucketed batch size and replayed. Inputs live in static
buffers; a batch is padded up to its bucket with slots of -1 (the KV store skips them) and
sequences of length 1 reading block 0, whose outputs are discarded. Prefill and mixed batches
run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.layers.context import AttentionMetadata, set_context
from engine.models.registry import CausalLM

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 513, 16))
    return [s for s in sizes if s < max_num_seqs] + [min(max_num_seqs, 512)]


class DecodeGraphs:
    def __init__(self, model: CausalLM, hidden_size: int, max_num_seqs: int,
                 max_blocks_per_seq: int, max_model_len: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.buckets = batch_buckets(max_num_seqs)
        self.max_bs = self.buckets[-1]
        self.max_model_len = max_model_len
        n, dev = self.max_bs, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: _POOL_HANDLE | None = None  # the memory pool the graphs share

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs],
                                 self.seq_lens[:bs], self.query_start_loc[: bs + 1],
                                 max_query_len=1, max_seq_len=self.max_model_len)

    @torch.inference_mode()
    def capture(self) -> None:
        for bs in reversed(self.buckets):  # largest first, so smaller graphs reuse its pool
            with set_context(self._meta(bs)):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, self.pool):
                    self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int, meta: AttentionMetadata) -> bool:
        return (meta.max_query_len == 1 and num_seqs <= self.max_bs
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        b = input_ids.shape[0]
        bs = next(s for s in self.buckets if s >= b)
        self.input_ids[:b] = input_ids
        self.positions[:b] = positions
        self.slot_mapping[:b] = meta.slot_mapping
        self.slot_mapping[b:bs] = -1
        self.seq_lens[:b] = meta.seq_lens
        self.seq_lens[b:bs] = 1
        self.block_tables[:b, : meta.block_tables.shape[1]] = meta.block_tables
        self.block_tables[b:bs] = 0
        self.graphs[bs].replay()
        return self.hidden[:b]
