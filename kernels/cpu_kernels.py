"""The engine's CPU kernels in C (``csrc/``): build, load, call. Which tensors each kernel
takes, and its Python face, are in ``cpu_launchers.py``.

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
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the C element type codes
FP8_CODE = 2  # fp8 E4M3 caches

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
    "dense_supported_cpu": [_c_int],
    "dense_pack_cpu": [_ptr, _ptr, _c_i64, _c_i64, _c_int, _c_int],
    "dense_linear_cpu": [_ptr] * 4 + [_c_i64] * 5 + [_c_int, _c_int],
    "dense_gated_supported_cpu": [_c_int, _c_i64],
    "dense_linear_gated_cpu": [_ptr] * 3 + [_c_i64] * 5 + [_c_int, _c_int],
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def compile_flags(isa: str | None = None) -> list[str]:
    """The compiler flags for a build for ``isa`` (default: this CPU's class under the cap of
    ``kernels.settings``)."""
    return [*FLAGS, *cpu_isa.march_flags(isa or settings.isa_class())]


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


def library() -> ctypes.CDLL:
    """The loaded library; RuntimeError where it is switched off or could not be built."""
    lib = (_lib or _load()) if settings.current().cpu_kernels else None
    if lib is None:
        raise RuntimeError("CPU kernels are not available (see the log); check available() first")
    return lib


def available() -> bool:
    """Whether the C kernels are switched on (``kernels.settings``) and built."""
    return settings.current().cpu_kernels and _load() is not None


def call(name: str, *args: object) -> int:
    """The library's ``name`` run on ``args``; RuntimeError on a negative (failure) code."""
    rc = int(getattr(library(), name)(*args))
    if rc < 0:
        raise RuntimeError(f"{name} failed with code {rc}")
    return rc
