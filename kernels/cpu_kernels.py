"""The engine's CPU kernels in C (``csrc/``): build, load, call.

``paged_attention_cpu.c`` is paged attention over the block table (no gather, no padding);
``elementwise_cpu.c`` holds RMSNorm (+ fused residual add), SiLU-and-multiply, rotary embedding,
the KV-cache store, grammar masks of logits, greedy argmax and top-p thresholds;
``int8_linear_cpu.c`` the int8 linear layers (activations quantized per row, VNNI dot products
where the CPU has them), ``dense_linear_cpu.c`` float32 and bfloat16 ones. AVX-512 or AVX2
loops where the CPU has them, plain C elsewhere; float32 and bfloat16.

The sources are compiled on first use with the system C compiler (``$CC``, else ``cc``) for this
machine's CPU (``-O3 -march=native -fopenmp``) into ``<build dir>/<hash>/``, keyed by the
sources, the flags and the CPU's feature flags; concurrent builders (several Ray workers) each
write a temporary file and rename it into place. The library is loaded with ctypes after torch,
so its OpenMP regions run on the libgomp torch already loaded (one thread pool), and ctypes
releases the GIL during a call.

Without a compiler, or with the ``cpu_kernels`` switch off (``kernels.settings``; the engine's
``cpu_kernels`` device setting, ``PAGEDSERVE_CPU_KERNELS=0``), ``available()`` is False and
``kernels.ops`` uses the pure-torch references instead (one warning in the log when there is no
compiler).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kernels import cpu_isa, settings

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention_cpu.c", CSRC / "elementwise_cpu.c", CSRC / "int8_linear_cpu.c",
           CSRC / "dense_linear_cpu.c", CSRC / "attention_amx_cpu.c"]
HEADERS = [CSRC / "cpu_common.h"]
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=fast", "-fno-math-errno",
         "-fno-trapping-math"]  # and -march for the CPU's class (kernels/cpu_isa.py)
MAX_HEAD = 256  # the attention kernel keeps one key row of up to 16 x 16 floats in registers
MAX_HIDDEN = 65536
DTYPES, _FP8 = {torch.float32: 0, torch.bfloat16: 1}, 2  # element types; 2: fp8 E4M3 caches


def _kv_dtype(query_dtype: torch.dtype, cache: torch.Tensor) -> int | None:
    """The C type code of a cache read with ``query_dtype`` activations, None if unsupported."""
    if cache.dtype == torch.float8_e4m3fn:
        return _FP8
    return DTYPES[query_dtype] if cache.dtype == query_dtype else None

_c_int, _c_i64, _c_f, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "paged_attention_cpu": [_ptr] * 7 + [_c_i64] + [_c_int] * 6 + [_c_i64, _c_i64, _c_f,
                                                                    _c_int, _c_f] + [_c_int] * 3,
    "rms_norm_cpu": [_ptr] * 4 + [_c_i64, _c_int, _c_i64, _c_i64, _c_i64, _c_f, _c_int, _c_int],
    "silu_and_mul_cpu": [_ptr, _ptr, _c_i64, _c_int, _c_i64, _c_i64, _c_int, _c_int],
    "rotary_cpu": [_ptr] * 4 + [_c_i64, _c_int, _c_int, _c_int] + [_c_i64] * 3 + [_c_int] * 2,
    "store_kv_cpu": [_ptr] * 5 + [_c_i64, _c_int, _c_int] + [_c_i64] * 4 + [_c_int] * 2 + [_c_f] * 2,
    "int8_linear_cpu": [_ptr] * 6 + [_c_i64] * 5 + [_c_int, _c_int],
    "mask_logits_cpu": [_ptr, _c_i64, _ptr, _c_i64, _ptr, _c_i64, _c_i64, _c_int, _c_int],
    "argmax_rows_cpu": [_ptr, _ptr, _c_i64, _c_i64, _c_i64, _c_int, _c_int],
    "top_p_threshold_cpu": [_ptr, _ptr, _c_i64, _c_i64, _c_i64, _ptr, _c_int],
    "dense_supported_cpu": [_c_int], "dense_pack_cpu": [_ptr, _ptr, _c_i64, _c_i64, _c_int, _c_int],
    "dense_linear_cpu": [_ptr] * 4 + [_c_i64] * 5 + [_c_int, _c_int],
    "dense_gated_supported_cpu": [_c_int, _c_i64],
    "dense_linear_gated_cpu": [_ptr] * 3 + [_c_i64] * 5 + [_c_int, _c_int],
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def compile_flags(isa: str | None = None) -> list[str]:
    """The compiler flags for a build for ``isa`` (default: this CPU's class, capped by
    ``PAGEDSERVE_CPU_ISA``)."""
    return [*FLAGS, *cpu_isa.march_flags(isa)]


def library_path(isa: str | None = None) -> Path:
    """Where the built library for these sources, compiler flags and CPU lives."""
    flags = " ".join(compile_flags(isa))
    digest = hashlib.sha256(flags.encode() + " ".join(sorted(cpu_isa.cpu_flags())).encode())
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    return settings.current().build_dir / digest.hexdigest()[:16] / "libpagedserve_cpu.so"


def build(isa: str | None = None) -> Path:
    """Compile the library (for ``isa``, default this CPU's capped class) if it is not built
    yet; returns its path. Raises RuntimeError. A build for a class above this CPU's compiles
    but must not be loaded here."""
    target = library_path(isa)
    if target.exists():
        return target
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *compile_flags(isa), *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(isa: str | None = None) -> ctypes.CDLL:
    """Build if needed and load the library for ``isa`` (default: this CPU's capped class);
    RuntimeError or OSError when it cannot. Tests load each class this CPU can run."""
    lib = ctypes.CDLL(str(build(isa)))
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = load()
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            logger.warning("CPU kernels unavailable, using the torch references: %s", e)
        _tried = True
        return _lib


def _library() -> ctypes.CDLL:
    lib = (_lib or _load()) if settings.current().cpu_kernels else None
    if lib is None:
        raise RuntimeError("CPU kernels are not available (see the log); check available() first")
    return lib


def available() -> bool:
    """Whether the C kernels are switched on (``kernels.settings``) and built."""
    return settings.current().cpu_kernels and _load() is not None


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
    _check(_library().paged_attention_cpu(
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
    _check(_library().rms_norm_cpu(
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
    _check(_library().silu_and_mul_cpu(out.data_ptr(), x.data_ptr(), x.shape[0], inter, x.stride(0),
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
    _check(_library().rotary_cpu(
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
    _check(_library().store_kv_cpu(
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
    _check(_library().mask_logits_cpu(
        logits.data_ptr(), logits.stride(0), bits.data_ptr(), bits.shape[1], idx.data_ptr(),
        len(rows), logits.shape[1], DTYPES[logits.dtype], torch.get_num_threads()),
        "mask_logits_cpu")


def call(name: str, *args: object) -> int:
    """The library's ``name`` run on ``args``; RuntimeError on a negative (failure) code."""
    rc = int(getattr(_library(), name)(*args))
    if rc < 0:
        raise RuntimeError(f"{name} failed with code {rc}")
    return rc
