"""Linear layers on the CPU through oneDNN with the weight reordered once, at load time.

``F.linear`` on a bfloat16 CPU tensor reaches oneDNN too, but reorders the weight into oneDNN's
blocked layout on every call; for the small M of decode steps that reorder costs as much as the
product (a [64, 896] x [896, 9728] product: 3.5 ms plain, 2.9 ms prepacked; at M=1, 0.6 vs 0.2 ms).
The prepacked product gives the same bits as ``F.linear``. Used for bfloat16 weights on CPUs with
AVX512-BF16 or AMX, and for float32 weights on every CPU: there ``F.linear`` goes to MKL's sgemm,
and oneDNN's prepacked product is 1.3-2.8x faster on decode shapes (the 0.5B model's LM head,
[16, 896] x [896, 151936]: 118 ms -> 43 ms capped to AVX2, 133 -> 30 ms with AVX-512; its
results match to float32 rounding, not bit for bit). The ``packed_gemm`` switch of
``kernels.settings`` (the engine's ``cpu_packed_gemm``) turns it off.

oneDNN builds (JIT-compiles) a kernel for every new row count M, 0.3-1 ms each; a serving
engine meets a new M in most steps (decodes plus prompt chunks of any length), and oneDNN keeps
1024 kernels at most. So rows are padded up to a bucket: M itself below 32, then 16 buckets per
doubling (a multiple of 2 up to 63, of 4 up to 127, ...), 128 buckets from 1 to 2048. A product
costs in proportion to its rows, so padding costs at most a sixteenth (coarser buckets, a
multiple of 8, made a 25-row decode step of the 0.5B model compute 32 rows: 23% more time in
its linears). ``warm_up`` builds the kernels of the small products at start-up.
"""

from __future__ import annotations

import torch

from kernels import cpu_isa, settings

_PACK_BATCH_HINT = 64  # oneDNN picks its blocking for this M; any M runs on the result
# A product of more multiply-adds than this takes milliseconds: building its kernel on first use
# (about 1 ms, once) is not worth running it at start-up
_WARM_UP_MACS = 1 << 28


def packing_supported(weight: torch.Tensor) -> bool:
    if not settings.current().packed_gemm:
        return False
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # unannotated in torch
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and cpu_isa.native_bf16()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> an opaque oneDNN tensor for ``packed_linear``."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    return packed


def take_packed(param: torch.Tensor, keep_plain: bool = False) -> torch.Tensor | None:
    """The parameter's weight prepacked when this CPU supports it (else None); unless
    ``keep_plain`` (a weight shared with the embedding), the plain copy is released."""
    if not packing_supported(param):
        return None
    packed = pack(param)
    if not keep_plain:
        param.data = param.data.new_empty(0)
    return packed


def padded_rows(m: int) -> int:
    """The bucket an M of ``m`` rows runs in: ``m`` rounded up to a multiple of
    2**(bit_length(m) - 5), at most m/16 more rows."""
    step = 1 << max(0, m.bit_length() - 5)
    return -(-m // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every bucket a product of 1 to ``max_rows`` rows can run in, ascending."""
    out = [padded_rows(1)]
    while out[-1] < max_rows:
        out.append(padded_rows(out[-1] + 1))
    return out


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ packed^T (+ bias) -> [M, N] (computed on M padded up to its bucket)."""
    if x.dim() != 2:
        return packed_linear(x.reshape(-1, x.shape[-1]), packed, bias).view(*x.shape[:-1], -1)
    m = x.shape[0]
    mp = padded_rows(m)
    if mp != m:  # rows are independent: the padding rows' products are dropped
        xp = x.new_empty((mp, x.shape[1]))
        xp[:m] = x
        xp[m:] = 0
        return _linear(xp, packed, bias)[:m]
    return _linear(x, packed, bias)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def warm_up(packed: list[tuple[torch.Tensor, torch.Tensor | None]], max_rows: int) -> int:
    """Build oneDNN's kernel of every row bucket up to ``max_rows`` for each distinct
    ``(packed weight [N, K], bias)`` shape, where the product is small enough for the kernel's
    build to matter; returns how many products ran."""
    seen: set[tuple[tuple[int, ...], bool]] = set()
    runs = 0
    for weight, bias in packed:
        n, k = weight.shape
        key = ((n, k), bias is not None)
        if key in seen:
            continue
        seen.add(key)
        for m in row_buckets(max_rows):
            if m * n * k > _WARM_UP_MACS:
                break
            _linear(torch.zeros(m, k, dtype=weight.dtype), weight, bias)
            runs += 1
    return runs
