"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the rows.

Quantized (``quantize``), the rows are int8 with one float32 scale per row (per output channel of
the LM head's product): the embedding looks rows up and scales them back to the model's dtype;
the LM head runs the int8 product of ``kernels.ops.matmul``. A tied LM head shares the
embedding's int8 values and scales."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce, divide, gather_last_dim, tp_rank, tp_size
from engine.loader import Loaded, ShardId, as_tensor, set_weight_loader, shard
from kernels import ops


class _VocabParallel(nn.Module):
    """A [vocab_size, hidden] weight of which this rank holds rows start..start+shard_size."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = divide(vocab_size, tp_size(), "vocab_size")
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        self.weight_scale: torch.Tensor | None = None  # quantized: [shard_size] float32
        self.dtype = self.weight.dtype  # the model's dtype (the weight's before quantizing)

    def quantize(self) -> None:
        """After loading: int8 rows with one scale each, in place (the parameter object stays,
        so a module sharing it sees the int8 values: give it ``weight_scale`` too)."""
        self.dtype = self.weight.dtype
        q, self.weight_scale = ops.quantize_int8(self.weight)
        self.weight.data = q

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        part = shard(loaded, 0, tp_rank(), tp_size(), self.shard_size, "embedding")
        if part.shape != param.shape:
            raise ValueError(f"embedding: expected shape {tuple(param.shape)}, checkpoint gives "
                             f"{tuple(part.shape)}")
        param.data.copy_(as_tensor(part))


class VocabParallelEmbedding(_VocabParallel):
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of this rank's shard, in the model's dtype."""
        if self.weight_scale is None:
            return F.embedding(ids, self.weight)
        rows = F.embedding(ids, self.weight).to(self.dtype)
        return rows.mul_(self.weight_scale[ids].unsqueeze(-1).to(self.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return self.lookup(input_ids)
        local = input_ids - self.start
        mask = (local >= 0) & (local < self.shard_size)
        out = self.lookup(local.clamp(0, self.shard_size - 1))
        out.mul_(mask.unsqueeze(-1).to(out.dtype))
        return all_reduce(out)


class ParallelLMHead(_VocabParallel):
    """Logits for the rows of ``hidden`` given; rank 0 receives the full vocabulary."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__(vocab_size, hidden)
        self.packed: ops.Packed | None = None
        self.int8: ops.Int8Packed | None = None

    def pack_weights(self, tied: bool) -> None:
        """After loading: prepack for the CPU's products; a tied weight stays for the embedding."""
        ops.prepack(self, keep_plain=tied)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = ops.matmul(self, hidden, None)
        return gather_last_dim(logits)
