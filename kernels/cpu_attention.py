"""The CPU paged-attention kernel (``csrc/paged_attention_cpu.c``): build, load, call.

The C file is compiled on first use with the system C compiler (``$CC``, else ``cc``) for this
machine's CPU (``-O3 -march=native -fopenmp``) into ``<cache dir>/kernels/<hash>/``, keyed by the
source, the flags and the CPU's feature flags; concurrent builders (several Ray workers) each
write a temporary file and rename it into place. It is loaded with ctypes after torch, so its
OpenMP calls run on the libgomp torch already loaded (one thread pool). ctypes releases the GIL
for the call.

Without a compiler, or with ``PAGEDSERVE_CPU_ATTENTION=0``, ``available()`` is False and
``kernels.ops`` uses the pure-torch reference instead (one warning in the log).
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

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=fast",
         "-fno-math-errno", "-fno-trapping-math"]  # lets expf vectorise (glibc libmvec)
MAX_HEAD = 256  # the C file's register tile holds 16 x 16 floats of a key row
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_flags() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def library_path() -> Path:
    """Where the built library for this source, compiler flags and CPU lives."""
    from engine import envs  # here: importing engine at module level would be circular

    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    return envs.cache_dir() / "kernels" / key / "libpaged_attention_cpu.so"


def build() -> Path:
    """Compile the library if it is not built yet; returns its path. Raises RuntimeError."""
    target = library_path()
    if target.exists():
        return target
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler {cc!r} on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("PAGEDSERVE_CPU_ATTENTION", "1") == "0":
            return None
        try:
            lib = ctypes.CDLL(str(build()))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            logger.warning("CPU paged-attention kernel unavailable, using the torch "
                           "reference: %s", e)
            return None
        fn = lib.paged_attention_cpu
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 7 + [
            ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_float, ctypes.c_int, ctypes.c_int]
        _lib = lib
        return _lib


def available() -> bool:
    return _load() is not None


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor,
             query_start_loc: torch.Tensor) -> bool:
    """Whether the C kernel takes these tensors as they are (else use the reference)."""
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in _DTYPES and k_cache.dtype == query.dtype
        and v_cache.dtype == query.dtype
        and query.stride(2) == 1 and query.stride(1) == head_size
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and head_size <= MAX_HEAD and num_q_heads % num_kv_heads == 0
        and all(t.dtype == torch.int32 and t.is_contiguous()
                for t in (block_tables, seq_lens, query_start_loc))
        and available()
    )


def paged_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """query [T, Hq, D] -> [T, Hq, D], the contract of ``kernels.ops.paged_attention``.
    Call ``supports`` first."""
    lib = _load()
    num_tokens, num_q_heads, head_size = query.shape
    out = torch.empty(query.shape, dtype=query.dtype)
    rc = lib.paged_attention_cpu(
        out.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), query_start_loc.data_ptr(),
        num_tokens, block_tables.shape[0], num_q_heads, k_cache.shape[2], head_size,
        k_cache.shape[1], block_tables.shape[1], query.stride(0), out.stride(0),
        scale, _DTYPES[query.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_attention_cpu failed with code {rc}")
    return out
