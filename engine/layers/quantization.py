"""Quantized linear weights: int8 or FP8 E4M3 values with one float32 scale per output channel
of a rank's shard, made from the loaded weight after loading (``quantize``) or read from a
quantized checkpoint (``expect_quantized`` before loading, ``finish_quantized`` after). The
linear layers (``linear.LinearBase``) carry these methods; the products that use the weights
are ``kernels.ops.matmul``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.loader import Loaded, ShardId, copy_checked, set_weight_loader
from kernels import ops

QUANTIZATION_METHODS = ("int8", "fp8")


class QuantizedWeights(nn.Module):
    """The quantized forms of a linear layer's [out, in] weight (a base of ``LinearBase``,
    which sets these attributes and loads the weight's rows)."""

    weight: nn.Parameter
    weight_scale: nn.Parameter | None  # [out] float32 ([out, 1] from a checkpoint, until finished)
    quantization: str | None  # "int8", "fp8", or None (the weight in the model's dtype)
    shard_dim: int | None  # the dimension of the full weight that ranks split (None: whole)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        raise NotImplementedError

    def quantize(self, method: str) -> None:
        """After loading: keep the weight as ``method`` (``QUANTIZATION_METHODS``): int8 or FP8
        E4M3 values with one float32 scale per output channel of this rank's shard. A layer
        already quantized (from its checkpoint) stays as it is."""
        if method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}")
        if self.quantization is None:
            quantize = ops.quantize_int8 if method == "int8" else ops.quantize_fp8
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
            copy_checked(param, loaded, "weight_scale")
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


def quantize_linears(model: nn.Module, method: str) -> int:
    """After loading: quantize every linear layer of ``model`` (not its embedding or LM head)
    to ``method``; returns how many were."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedWeights)]
    for m in layers:
        m.quantize(method)
    return len(layers)


def expect_quantized_linears(model: nn.Module, weight_type: str, packed: bool) -> None:
    """Before loading a quantized checkpoint (``CheckpointQuant``'s ``weight_type``, "int" or
    "float", and ``packed``): every linear layer takes the checkpoint's weights and scales."""
    dtype = torch.int8 if weight_type == "int" else torch.float8_e4m3fn
    for m in model.modules():
        if isinstance(m, QuantizedWeights):
            m.expect_quantized(dtype, packed)


def finish_quantized_linears(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if isinstance(m, QuantizedWeights):
            m.finish_quantized(name)
