"""The C kernels' launchers (``csrc/``, built and loaded by ``cpu_kernels.py``): for each, a
``supports_*`` check of the tensors it takes as they are (dtypes, strides, sizes; and the
library available) and the call, with the contract of the torch reference ``kernels.ops``
falls back to.
"""

from __future__ import annotations

import torch

from kernels.cpu_kernels import DTYPES, FP8_CODE, available, library

MAX_HEAD = 256  # the attention kernel keeps one key row of up to 16 x 16 floats in registers
MAX_HIDDEN = 65536


def _kv_dtype(query_dtype: torch.dtype, cache: torch.Tensor) -> int | None:
    """The C type code of a cache read with ``query_dtype`` activations, None if unsupported."""
    if cache.dtype == torch.float8_e4m3fn:
        return FP8_CODE
    return DTYPES[query_dtype] if cache.dtype == query_dtype else None


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name} failed with code {rc}")


def _rows_ok(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """A CPU [T, H] tensor of a supported type, contiguous along its last dim."""
    return (t.device.type == "cpu" and t.dtype in DTYPES and t.dim() == 2
            and (dtype is None or t.dtype == dtype) and (t.stride(1) == 1 or t.shape[1] == 1))


def supports_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor,
                       query_start_loc: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors as they are (else use the reference)."""
    num_q_heads, head_size = query.shape[1], query.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES and _kv_dtype(query.dtype, k_cache) is not None
        and v_cache.dtype == k_cache.dtype
        and query.stride(2) == 1 and query.stride(1) == head_size
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and head_size <= MAX_HEAD and num_q_heads % k_cache.shape[2] == 0
        and all(t.dtype == torch.int32 and t.is_contiguous()
                for t in (block_tables, seq_lens, query_start_loc))
        and available()
    )


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, sliding_window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D]: the contract of ``kernels.ops.paged_attention``."""
    out = torch.empty(query.shape, dtype=query.dtype)
    _check(library().paged_attention_cpu(
        out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
        query.shape[0], block_tables.shape[0], query.shape[1], k_cache.shape[2], query.shape[2],
        k_cache.shape[1], block_tables.shape[1], query.stride(0), out.stride(0), scale,
        sliding_window or 0, softcap or 0.0, DTYPES[query.dtype],
        _kv_dtype(query.dtype, k_cache), torch.get_num_threads()), "paged_attention_cpu")
    return out


def supports_norm(x: torch.Tensor, weight: torch.Tensor,
                  residual: torch.Tensor | None = None) -> bool:
    return (_rows_ok(x) and weight.dtype == x.dtype and weight.is_contiguous()
            and weight.shape == (x.shape[1],) and x.shape[1] <= MAX_HIDDEN
            and (residual is None or (_rows_ok(residual, x.dtype)
                                      and residual.shape == x.shape))
            and available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm(x) * weight; with ``residual``: residual <- x + residual first (in place) and
    the new residual is normalised."""
    out = torch.empty(x.shape, dtype=x.dtype)
    _check(library().rms_norm_cpu(
        out.data_ptr(), x.data_ptr(), None if residual is None else residual.data_ptr(),
        weight.data_ptr(), x.shape[0], x.shape[1], x.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), eps, DTYPES[x.dtype],
        torch.get_num_threads()), "rms_norm_cpu")
    return out


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return _rows_ok(x) and x.shape[1] % 2 == 0 and available()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype)
    _check(library().silu_and_mul_cpu(out.data_ptr(), x.data_ptr(), x.shape[0], inter, x.stride(0),
                                 out.stride(0), DTYPES[x.dtype], torch.get_num_threads()),
           "silu_and_mul_cpu")
    return out


def supports_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    cos_sin_cache: torch.Tensor, head_size: int) -> bool:
    return (_rows_ok(query) and _rows_ok(key, query.dtype) and head_size % 2 == 0
            and query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.device.type == "cpu"
            and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.stride(1) == 1
            and cos_sin_cache.shape[1] == head_size and available())


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    _check(library().rotary_cpu(
        positions.data_ptr(), query.data_ptr(), key.data_ptr(), cos_sin_cache.data_ptr(),
        query.shape[0], query.shape[1] // head_size, key.shape[1] // head_size, head_size,
        query.stride(0), key.stride(0), cos_sin_cache.stride(0), DTYPES[query.dtype],
        torch.get_num_threads()), "rotary_cpu")


def supports_store(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    return (key.device.type == "cpu" and key.dim() == 3 and value.shape == key.shape
            and key.dtype == value.dtype and key.dtype in DTYPES
            and k_cache.dtype == v_cache.dtype and _kv_dtype(key.dtype, k_cache) is not None
            and key.shape[2] <= MAX_HEAD
            and key.stride(2) == 1 and value.stride(2) == 1
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape == v_cache.shape and k_cache.shape[2:] == key.shape[1:]
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and available())


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """The contract of ``kv_cache.store_kv_cache_ref`` (fp8 caches bit-identical to it)."""
    _check(library().store_kv_cpu(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), key.shape[0], key.shape[1], key.shape[2], key.stride(0),
        key.stride(1), value.stride(0), value.stride(1), DTYPES[key.dtype],
        _kv_dtype(key.dtype, k_cache), 1.0 / k_scale, 1.0 / v_scale), "store_kv_cpu")


def supports_mask(logits: torch.Tensor) -> bool:
    return _rows_ok(logits) and available()


def mask_logits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t]`` to -inf where bit t of ``bitmask[r]`` (xgrammar's [rows, words]
    int32 token bitmask) is 0, for r in ``rows``, in place."""
    idx, bits = torch.tensor(rows, dtype=torch.int64), bitmask.to(torch.int32).contiguous()
    _check(library().mask_logits_cpu(
        logits.data_ptr(), logits.stride(0), bits.data_ptr(), bits.shape[1], idx.data_ptr(),
        len(rows), logits.shape[1], DTYPES[logits.dtype], torch.get_num_threads()),
        "mask_logits_cpu")
