"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, divide, gather_last_dim, tp_rank, tp_size
from engine.loader import Loaded, ShardId, as_tensor, set_weight_loader, shard
from kernels import cpu_gemm


class _VocabParallel(nn.Module):
    """A [vocab_size, hidden] weight of which this rank holds rows start..start+shard_size."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = divide(vocab_size, tp_size(), "vocab_size")
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        part = shard(loaded, 0, tp_rank(), tp_size(), self.shard_size, "embedding")
        if part.shape != param.shape:
            raise ValueError(f"embedding: expected shape {tuple(param.shape)}, checkpoint gives "
                             f"{tuple(part.shape)}")
        param.data.copy_(as_tensor(part))


class VocabParallelEmbedding(_VocabParallel):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        out.mul_(mask.unsqueeze(-1).to(out.dtype))
        return all_reduce(out)


class ParallelLMHead(_VocabParallel):
    """Logits for the rows of ``hidden`` given; rank 0 receives the full vocabulary."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__(vocab_size, hidden)
        self.packed: torch.Tensor | None = None

    def pack_weights(self, tied: bool) -> None:
        """After loading: prepack for oneDNN on the CPU; a tied weight stays for the embedding."""
        if self.packed is None:
            self.packed = cpu_gemm.take_packed(self.weight, keep_plain=tied)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.packed is not None:
            return gather_last_dim(cpu_gemm.packed_linear(hidden, self.packed, None))
        return gather_last_dim(F.linear(hidden, self.weight))
