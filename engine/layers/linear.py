"""Tensor-parallel linear layers. Each owns its weight loader: it is handed a checkpoint tensor
(a ``TensorSlice`` still on disk, or a tensor) and, for packed layers, which part it is, and
reads in this rank's shard only.

- ``ColumnParallelLinear``: output features split across ranks (no communication).
- ``MergedColumnParallelLinear``: several column-parallel outputs packed in one matmul (gate/up).
- ``QKVParallelLinear``: q, k and v packed; KV heads split, or replicated when fewer than ranks.
- ``RowParallelLinear``: input features split; partial outputs summed with an all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import all_reduce, divide, tp_rank, tp_size
from engine.layers import weights
from engine.loader import Loaded, ShardId, TensorSlice, as_tensor, set_weight_loader, shard
from kernels import cpu_gemm, quant_linear
from kernels.cpu_gemm import Packed
from kernels.fp8_linear import quantize_fp8
from kernels.quant_linear import Int8Packed

QUANTIZATION_METHODS = ("int8", "fp8")


def _copy_checked(param: torch.Tensor, part: Loaded, name: str) -> None:
    if param.shape != part.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, checkpoint gives "
                         f"{tuple(part.shape)}")
    param.data.copy_(as_tensor(part))


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


class LinearBase(nn.Module):
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
        self.packed: Packed | None = None  # the weight prepacked for the CPU (cpu_gemm)
        self.quantization: str | None = None
        # int8: one float32 scale per output channel (a parameter: a quantized checkpoint
        # loads it, [out, 1] until ``finish_quantized``)
        self.weight_scale: nn.Parameter | None
        self.register_parameter("weight_scale", None)
        self.int8: Int8Packed | None = None  # int8 packed for the C kernel (CPU)

    def quantize(self, method: str) -> None:
        """After loading: keep the weight as ``method`` (``QUANTIZATION_METHODS``): int8 or FP8
        E4M3 values with one float32 scale per output channel of this rank's shard. A layer
        already quantized (from its checkpoint) stays as it is."""
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
        if self.quantization is None:
            quantize = quant_linear.quantize_int8 if method == "int8" else quantize_fp8
            self._set_quantized(*quantize(self.weight))

    def _set_quantized(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.float().to(q.device), requires_grad=False)
        self.quantization = "int8" if q.dtype == torch.int8 else "fp8"

    def expect_quantized(self, weight_dtype: torch.dtype, packed: bool = False) -> None:
        """Before loading a quantized checkpoint: the weight as stored there (int8 or
        float8_e4m3fn; ``packed``: int8 values four to an int32 word along the inputs, as
        ``weight_packed``) and its per-output-channel ``weight_scale`` [out, 1]."""
        dev, (n, k) = self.weight.device, self.weight.shape
        if packed:
            if k % 4:
                raise ValueError(f"packed int8 weights need a multiple of 4 input features "
                                 f"per rank, got {k}")
            del self.weight
            self.weight_packed = nn.Parameter(torch.empty(n, k // 4, dtype=torch.int32,
                                                          device=dev), requires_grad=False)
            set_weight_loader(self.weight_packed, self.weight_loader)
        else:
            self.weight = nn.Parameter(torch.empty(n, k, dtype=weight_dtype, device=dev),
                                       requires_grad=False)
            set_weight_loader(self.weight, self.weight_loader)
        self.weight_scale = nn.Parameter(torch.empty(n, 1, device=dev), requires_grad=False)
        set_weight_loader(self.weight_scale, self._scale_loader)

    def _scale_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        if self.shard_dim == 1:  # row-parallel: every rank has every output channel
            _copy_checked(param, loaded, "weight_scale")
        else:  # the rows of this rank's output channels, like the weight's
            self.weight_loader(param, loaded, shard_id)

    def finish_quantized(self, name: str) -> None:
        """After loading a quantized checkpoint: check the scales and keep the weight as int8
        (FP8 values are requantized to int8 per output channel: one int8 path on every
        device, at the cost of a second rounding)."""
        scale = self.weight_scale
        assert scale is not None, "expect_quantized first"
        flat = scale.data.reshape(-1).float()
        if not bool(torch.isfinite(flat).all()) or bool((flat <= 0).any()):
            raise ValueError(f"{name}.weight_scale: scales must be finite and positive")
        words = self._parameters.get("weight_packed")
        if words is not None:  # compressed-tensors' own unpacking
            from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

            q = unpack_from_int32(words.data, 8, torch.Size((words.shape[0], words.shape[1] * 4)))
            del self.weight_packed
            self._set_quantized(q, flat)
        else:  # int8 or FP8 values, kept as the file has them
            self._set_quantized(self.weight.data, flat)

    def pack_weights(self) -> None:
        """After loading: on CPUs that support it, keep the weight in its prepacked layout only."""
        weights.prepack(self)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return weights.matmul(self, x, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        dim = self.shard_dim
        if dim is not None and not (dim == 1 and loaded.dim() == 1):  # row-parallel bias: whole
            loaded = shard(loaded, dim, tp_rank(), tp_size(), param.shape[dim])
        _copy_checked(param, loaded, "weight")

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
        return isinstance(self.packed, cpu_gemm.DensePacked) and self.packed.gated

    def pack_weights(self) -> None:
        if (self.gated_silu and self.bias is None and self.weight_scale is None
                and self.packed is None and len(self.output_sizes) == 2
                and self.output_sizes[0] == self.output_sizes[1]):
            self.packed = cpu_gemm.take_gated(self.weight)
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
        _copy_checked(target, part, f"part {shard_id}")


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
        _copy_checked(target, part, f"{shard_id}_proj")


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


def quantize_linears(model: nn.Module, method: str) -> int:
    """After loading: quantize every linear layer of ``model`` (not its embedding or LM head)
    to ``method``; returns how many were."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for m in layers:
        m.quantize(method)
    return len(layers)


def expect_quantized_linears(model: nn.Module, weight_type: str, packed: bool) -> None:
    """Before loading a quantized checkpoint (``CheckpointQuant``'s ``weight_type``, "int" or
    "float", and ``packed``): every linear layer takes the checkpoint's weights and scales."""
    dtype = torch.int8 if weight_type == "int" else torch.float8_e4m3fn
    for m in model.modules():
        if isinstance(m, LinearBase):
            m.expect_quantized(dtype, packed)


def finish_quantized_linears(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            m.finish_quantized(name)
