"""Store the new tokens' keys and values into the paged KV cache through the slot mapping.

slot = block_id * block_size + offset; slot -1 marks a padding token that is skipped. The cache
holds the keys' own dtype or fp8 E4M3 (``FP8_KV_DTYPE``): then each value is multiplied by the
inverse of its per-tensor scale (``k_scale``/``v_scale``, 1.0 unless a checkpoint gives one),
rounded to nearest even and saturated at +-448, as torch converts; attention multiplies back.
"""

from __future__ import annotations

import torch

from kernels._triton import next_power_of_2, tl, triton
from kernels.fp8_linear import FP8

FP8_KV_DTYPE = FP8  # what an fp8 cache holds (the FP8 type of the weights)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x as the cache stores it: fp8 after multiplying by the float32 inverse of ``scale``,
    saturated at +-448 (NaN stays NaN). The clamp is explicit because torch's own conversion
    changed between versions: the GPU image's torch 2.11 gave NaN for infinities and values
    past 480 where 2.13 saturates, so the reference, the C kernel and Triton disagreed there."""
    if dtype == FP8_KV_DTYPE:
        return (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value [T, Hk, D] -> k_cache/v_cache [num_blocks, block_size, Hk, D] (views allowed)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache_dtype(key[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = to_cache_dtype(value[keep], v_cache.dtype, v_scale)


@triton.jit
def fp8_bits(x):
    """The fp8 E4M3 byte of float32 x (rounded to nearest even, saturated at +-448, NaN kept as
    NaN), built from x's bits as the C kernels' ``f32_to_fp8`` does. Built by hand rather than
    by Triton's conversion, the bytes are the same everywhere: the interpreter's conversion loses
    the carry into the exponent (1.97 becomes 1.0), the subnormals and NaN (it gives 256)."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    tiny = a < 0x3C800000  # below 2^-6: subnormal steps of 2^-9, rounded by a float add
    small = tl.where(tiny, a.to(tl.float32, bitcast=True), 0.0)
    sub = (((small + 16384.0) - 16384.0) * 512.0).to(tl.uint32)
    normal = (((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)) & 0x7F
    mag = tl.where(tiny, sub, normal)
    mag = tl.where(a >= 0x43E00000, 0x7E, mag)  # 448 and above, infinities too
    mag = tl.where(a > 0x7F800000, 0x7F, mag)  # NaN
    return (sign | mag).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, Hk, D] strides (stride_kt, stride_kh, 1)
    value_ptr,  # [T, Hk, D] strides (stride_vt, stride_vh, 1)
    k_cache_ptr,  # [num_blocks, block_size, Hk, D] strides (stride_cb, stride_co, stride_ch, 1)
    v_cache_ptr,  # [num_blocks, block_size, Hk, D] same strides as k_cache
    slot_mapping_ptr,  # [T] int64, -1 = padding token (skipped)
    k_inv_scale, v_inv_scale,  # fp8 caches: multipliers before the conversion
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    num_kv_heads,
    head_size,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_H: tl.constexpr,  # next power of two >= Hk
    BLOCK_D: tl.constexpr,  # next power of two >= D
    FP8: tl.constexpr,  # the caches hold fp8 E4M3: scale, saturate at +-448, round to nearest
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # A padding token stores no heads. A block mask is never and-ed with a scalar comparison:
    # Triton 3.9's interpreter rejects the result ("mask has unsupported dtype").
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (heads < live_heads) & (dims < head_size)
    # int64 throughout: block * stride_cb exceeds 2**31 on large caches.
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + heads * stride_ch + dims
    k = tl.load(key_ptr + tok * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8:  # the caches come as bytes
        tl.store(k_cache_ptr + dst, fp8_bits(k.to(tl.float32) * k_inv_scale), mask=mask)
        tl.store(v_cache_ptr + dst, fp8_bits(v.to(tl.float32) * v_inv_scale), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check_store_args(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key/value must be [T, Hk, D] alike, got {tuple(key.shape)} {tuple(value.shape)}")
    tokens, num_kv_heads, head_size = key.shape
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (num_kv_heads, head_size):
        raise ValueError(f"k_cache must be [num_blocks, block_size, {num_kv_heads}, {head_size}], got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("v_cache must have k_cache's shape and strides")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} must equal k_cache dtype {k_cache.dtype}")
    if k_cache.dtype not in (key.dtype, FP8_KV_DTYPE):
        raise ValueError(f"cache dtype {k_cache.dtype} must be the keys' {key.dtype} or fp8 e4m3")
    block_size = k_cache.shape[1]
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be [{tokens}] int32/int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if len({t.device for t in (key, value, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError("key, value, caches and slot_mapping must be on one device")


def store_kv_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton KV store: key/value [T, Hk, D] -> caches at slot_mapping [T]; -1 is skipped."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping)
    tokens, num_kv_heads, head_size = key.shape
    if tokens == 0:
        return
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    if fp8:  # the kernel writes the fp8 bytes it builds (fp8_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_size,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_size), FP8=fp8, num_warps=4,
    )
