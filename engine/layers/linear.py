"""Tensor-parallel linear layers. Each owns its weight loader: it is handed a checkpoint tensor
(a ``TensorSlice`` still on disk, or a tensor) and, for packed layers, which part it is, and
reads in this rank's shard only.

- ``ColumnParallelLinear``: output features split across ranks (no communication).
- ``MergedColumnParallelLinear``: several column-parallel outputs packed in one matmul (gate/up).
- ``QKVParallelLinear``: q, k and v packed; KV heads split, or replicated when fewer than ranks.
- ``RowParallelLinear``: input features split; partial outputs summed with an all-reduce.

Their weights' quantized forms are ``quantization.QuantizedWeights``' (a base of ``LinearBase``);
the products, whatever form a weight is in, are ``kernels.ops.matmul``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import all_reduce, divide, tp_rank, tp_size
from engine.layers.quantization import QuantizedWeights
from engine.loader import Loaded, ShardId, TensorSlice, copy_checked, set_weight_loader, shard
from kernels import ops


class FusedPart(TensorSlice):
    """Rows ``[start, start + length)`` of a fused checkpoint tensor (Phi-3's ``qkv_proj``,
    ``gate_up_proj``), still unread when the tensor is a ``TensorSlice``: narrowing it reads
    only the rows asked for, so a rank reads its q, k, v (gate, up) shards and nothing else."""

    def __init__(self, loaded: Loaded, start: int, length: int):
        self._whole, self._start = loaded, start
        self.shape = torch.Size((length, *loaded.shape[1:]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._whole.narrow(0, self._start + start, length)
        return self.read().narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        return self._whole.narrow(0, self._start, self.shape[0])


def _check_fused_rows(loaded: Loaded, rows: int, what: str) -> None:
    if loaded.shape[0] != rows:
        raise ValueError(f"fused {what}: expected {rows} rows, checkpoint gives "
                         f"{tuple(loaded.shape)}")


class LinearBase(QuantizedWeights):
    def __init__(self, in_features: int, out_features: int, bias: bool, shard_dim: int | None):
        super().__init__()
        self.shard_dim = shard_dim  # dimension of the full weight that ranks split (None: whole)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)
        self.packed: ops.Packed | None = None  # the weight prepacked for the CPU
        self.quantization: str | None = None
        # int8: one float32 scale per output channel (a parameter: a quantized checkpoint
        # loads it, [out, 1] until ``finish_quantized``)
        self.weight_scale: nn.Parameter | None
        self.register_parameter("weight_scale", None)
        self.int8: ops.Int8Packed | None = None  # int8 packed for the C kernel (CPU)

    def pack_weights(self) -> None:
        """After loading: on CPUs that support it, keep the weight in its prepacked layout only."""
        ops.prepack(self)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return ops.matmul(self, x, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        dim = self.shard_dim
        if dim is not None and not (dim == 1 and loaded.dim() == 1):  # row-parallel bias: whole
            loaded = shard(loaded, dim, tp_rank(), tp_size(), param.shape[dim])
        copy_checked(param, loaded, "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias, None)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, tp_size(), "output size"), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """``output_sizes`` packed along the output dimension; shard ``i`` loads part ``i``, and
    shard None a checkpoint tensor with every part fused in order (Phi-3's ``gate_up_proj``)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)
        # set by an MLP that applies SiLU-and-multiply to the two parts: packing may then fuse it
        # into the product (``activated``)
        self.gated_silu = False

    @property
    def activated(self) -> bool:
        """Whether the output is already silu(gate) * up (the C kernel's fused product)."""
        return isinstance(self.packed, ops.DensePacked) and self.packed.gated

    def pack_weights(self) -> None:
        if (self.gated_silu and self.bias is None and self.weight_scale is None
                and self.packed is None and len(self.output_sizes) == 2
                and self.output_sizes[0] == self.output_sizes[1]):
            self.packed = ops.take_gated(self.weight)
        super().pack_weights()

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        if shard_id is None:  # fused: each part's rows in turn
            _check_fused_rows(loaded, sum(self.output_sizes), "gate_up_proj")
            for i, size in enumerate(self.output_sizes):
                start = sum(self.output_sizes[:i])
                self.weight_loader(param, FusedPart(loaded, start, size), i)
            return
        if not isinstance(shard_id, int):
            raise TypeError(f"packed part index expected, got {shard_id!r}")
        tp = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        target = param.data.narrow(0, offset, size)
        part = shard(loaded, 0, tp_rank(), tp, size, f"part {shard_id}")
        copy_checked(target, part, f"part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v packed: shard "q", "k" or "v" loads that part, and shard None a checkpoint
    tensor with all three fused in that order (Phi-3's ``qkv_proj``)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
        else:  # fewer KV heads than ranks: each rank keeps one, replicated
            divide(tp, num_kv_heads, "tensor_parallel_size over num_key_value_heads")
            self.num_kv_heads = 1
        self.num_kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden, out, bias, 0)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id is None:  # fused: the whole q, k and v rows in turn
            tp = tp_size()
            full_q, full_kv = q * tp, kv * (tp // self.num_kv_replicas)
            _check_fused_rows(loaded, full_q + 2 * full_kv, "qkv_proj")
            for sid, start, size in (("q", 0, full_q), ("k", full_q, full_kv),
                                     ("v", full_q + full_kv, full_kv)):
                self.weight_loader(param, FusedPart(loaded, start, size), sid)
            return
        parts: dict[ShardId, tuple[int, int]] = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        offset, size = parts[shard_id]
        tp, replicas = tp_size(), (1 if shard_id == "q" else self.num_kv_replicas)
        target = param.data.narrow(0, offset, size)
        part = shard(loaded, 0, tp_rank() // replicas, tp // replicas, size, f"{shard_id}_proj")
        copy_checked(target, part, f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, tp_size(), "input size"), out_features, bias, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None)
        if tp_size() > 1:
            all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
]
