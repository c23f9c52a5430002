"""Linear layers on the CPU with the weight packed once, at load time.

On every class with vector units (float32 weights; bfloat16 where bf16 is native) the weight
goes to this project's C kernel (``csrc/dense_linear_cpu.c``, ``DensePacked``): it reads the
next weight panel from memory while it computes on this one, which oneDNN does not, so a decode
step's products run 1.05-1.4x faster than oneDNN's prepacked ones; prompt-sized products
(compute bound) are about even (``load_tests/gemm_bench.py``). On AMX its bfloat16 products run
on the tile registers; a call also costs microseconds where oneDNN's costs about 30.

Elsewhere (the generic class; C kernels off) the weight is reordered once into oneDNN's blocked
layout.
``F.linear`` on a bfloat16 CPU tensor reaches oneDNN too, but reorders the weight on every
call; for the small M of decode steps that reorder costs as much as the product (a [64, 896] x
[896, 9728] product: 3.5 ms plain, 2.9 ms prepacked; at M=1, 0.6 vs 0.2 ms). The prepacked
bfloat16 product gives the same bits as ``F.linear``; for float32 ``F.linear`` goes to MKL's
sgemm, and oneDNN's prepacked product is 1.3-2.8x faster on decode shapes (results match to
float32 rounding, not bit for bit). The ``packed_gemm`` switch of ``kernels.settings`` (the
engine's ``cpu_packed_gemm``) turns packing off.

oneDNN builds (JIT-compiles) a kernel for every new row count M, 0.3-1 ms each; a serving
engine meets a new M in most steps (decodes plus prompt chunks of any length), and oneDNN keeps
1024 kernels at most. So rows are padded up to a bucket: M itself below 32, then 16 buckets per
doubling (a multiple of 2 up to 63, of 4 up to 127, ...), 128 buckets from 1 to 2048. A product
costs in proportion to its rows, so padding costs at most a sixteenth (coarser buckets, a
multiple of 8, made a 25-row decode step of the 0.5B model compute 32 rows: 23% more time in
its linears). ``warm_up`` builds the kernels of the small products at start-up.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import cpu_kernels, settings

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
    return weight.dtype == torch.bfloat16 and settings.native_bf16()


class DensePacked(NamedTuple):
    """A weight [n, k] in ``dense_linear_cpu.c``'s layout (``data``, flat). ``gated``: a gate
    and an up weight [n, k] each, interleaved by ``pack_gated``; the product is then
    silu(x @ gate^T) * (x @ up^T), [M, n]."""

    data: torch.Tensor
    n: int
    k: int
    gated: bool = False


Packed = torch.Tensor | DensePacked  # a oneDNN tensor, or the C kernel's layout


def _dense_panel(dtype: torch.dtype) -> int:
    """The C kernel's panel width for ``dtype`` weights in the built library, 0 if it has none."""
    if dtype not in cpu_kernels.DTYPES or not cpu_kernels.available():
        return 0
    return cpu_kernels.call("dense_supported_cpu", cpu_kernels.DTYPES[dtype])


def dense_kernel_used(weight: torch.Tensor) -> bool:
    """Whether a packable weight goes to the C kernel: float32 on the avx2, avx512,
    avx512_bf16 and amx classes, bfloat16 on avx512_bf16 and amx (AMX tiles where the inputs
    are a multiple of 32). Against oneDNN's prepacked products on AMX, offline, alternating
    runs: the 0.5B model in bfloat16 1.08-1.24x, the default model in float32 1.08-1.12x."""
    return (settings.isa_class() in ("avx2", "avx512", "avx512_bf16", "amx")
            and _dense_panel(weight.dtype) > 0)


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> an opaque oneDNN tensor for ``packed_linear``."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
    return packed


def pack(weight: torch.Tensor) -> Packed:
    """weight [N, K] -> its prepacked form for ``packed_linear`` (see ``dense_kernel_used``)."""
    if not dense_kernel_used(weight):
        return pack_onednn(weight)
    n, k = weight.shape
    w, panel = weight.detach().contiguous(), _dense_panel(weight.dtype)
    inputs = k + k % 2 if w.dtype == torch.bfloat16 else k  # bfloat16 inputs go in pairs
    data = torch.empty(-(-n // panel) * panel * inputs, dtype=w.dtype)
    cpu_kernels.call("dense_pack_cpu", data.data_ptr(), w.data_ptr(), n, k,
                     cpu_kernels.DTYPES[w.dtype], torch.get_num_threads())
    return DensePacked(data, n, k)


def pack_gated(weight: torch.Tensor) -> DensePacked | None:
    """A gate-up weight [2n, k] (gate rows, then up rows) -> the C kernel's fused form, whose
    product is SiLU-and-multiply of the two (``silu(gate) * up``, [M, n]) in one pass; None where
    the kernel has no fused product for it (no C dense kernel for the dtype on this CPU class)."""
    two_n, k = weight.shape
    if two_n % 2 or not packing_supported(weight) or not dense_kernel_used(weight):
        return None
    half = cpu_kernels.call("dense_gated_supported_cpu", cpu_kernels.DTYPES[weight.dtype], k)
    if not half:
        return None
    n = two_n // 2
    blocks = -(-n // half)
    parts = weight.detach().new_zeros(2, blocks * half, k)  # gate, up; padded to blocks of half
    parts[0, :n], parts[1, :n] = weight[:n], weight[n:]
    interleaved = parts.view(2, blocks, half, k).transpose(0, 1).reshape(blocks * 2 * half, k)
    dense = pack(interleaved)
    assert isinstance(dense, DensePacked)
    return DensePacked(dense.data, n, k, gated=True)


def take_gated(param: torch.Tensor) -> DensePacked | None:
    """``pack_gated`` of a parameter, whose plain copy is then released; None (kept) where
    there is no fused product for it."""
    packed = pack_gated(param)
    if packed is not None:
        param.data = param.data.new_empty(0)
    return packed


def take_packed(param: torch.Tensor, keep_plain: bool = False) -> Packed | None:
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


def packed_linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ packed^T (+ bias) -> [M, N] (oneDNN: computed on M padded up to its bucket)."""
    if x.dim() != 2:
        return packed_linear(x.reshape(-1, x.shape[-1]), packed, bias).view(*x.shape[:-1], -1)
    if isinstance(packed, DensePacked):
        return _dense_linear(x, packed, bias)
    m = x.shape[0]
    mp = padded_rows(m)
    if mp != m:  # rows are independent: the padding rows' products are dropped
        xp = x.new_empty((mp, x.shape[1]))
        xp[:m] = x
        xp[m:] = 0
        return _linear(xp, packed, bias)[:m]
    return _linear(x, packed, bias)


def _dense_linear(x: torch.Tensor, w: DensePacked, bias: torch.Tensor | None) -> torch.Tensor:
    if x.stride(1) != 1 or x.dtype != w.data.dtype:
        x = x.contiguous().to(w.data.dtype)
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        bias = bias.to(x.dtype).contiguous()
    out = torch.empty((x.shape[0], w.n), dtype=x.dtype)
    if w.gated:
        if bias is not None:
            raise ValueError("a gated product takes no bias")
        if x.shape[0]:
            cpu_kernels.call("dense_linear_gated_cpu", out.data_ptr(), x.data_ptr(),
                             w.data.data_ptr(), x.shape[0], w.n, w.k, x.stride(0), out.stride(0),
                             cpu_kernels.DTYPES[x.dtype], torch.get_num_threads())
        return out
    if x.shape[0]:
        cpu_kernels.call("dense_linear_cpu", out.data_ptr(), x.data_ptr(), w.data.data_ptr(),
                         None if bias is None else bias.data_ptr(), x.shape[0], w.n, w.k,
                         x.stride(0), out.stride(0), cpu_kernels.DTYPES[x.dtype],
                         torch.get_num_threads())
    return out


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def warm_up(packed: list[tuple[Packed, torch.Tensor | None]], max_rows: int) -> int:
    """Build oneDNN's kernel of every row bucket up to ``max_rows`` for each distinct
    ``(packed weight [N, K], bias)`` shape, where the product is small enough for the kernel's
    build to matter; returns how many products ran (the C kernel builds nothing per shape)."""
    seen: set[tuple[tuple[int, ...], bool]] = set()
    runs = 0
    for weight, bias in packed:
        if isinstance(weight, DensePacked):
            continue
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
