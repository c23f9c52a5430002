"""The one switch board of ``kernels``: which backend runs, the CPU kernels' switches, and the
facts of the machine those switches are read against (the CPU's class under the cap, native
bfloat16, FP8). Set by its user (the engine, from its config's device section; a test or a
benchmark); ``kernels`` reads no environment variable of this project's, only the tools' own
(``CC``, ``TRITON_INTERPRET``).

| field | meaning | default |
|---|---|---|
| ``backend`` | "auto": Triton on CUDA tensors, the C kernels or the references on CPU ones; "triton": Triton everywhere (on the CPU under ``TRITON_INTERPRET=1``); "reference": the torch references | "auto" |
| ``cpu_kernels`` | use the C kernels (else the torch references) | on |
| ``packed_gemm`` | prepack CPU linear weights (the C dense kernel, int8 kernel or oneDNN) | on |
| ``build_dir`` | where the C kernels are built | ``~/.cache/pagedserve/kernels`` |
| ``isa_cap`` | build and choose as on a CPU of this class at most (``ISA_CLASSES``) | none |

``use_triton`` and ``use_cpu`` say, per tensor, where ``kernels.ops`` sends a call; they read a
module global (the backend of the settings in force), as cheap as a flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kernels import cpu_isa
from kernels._triton import HAS_TRITON
from kernels.fp8_linear import FP8, fp8_capable

BACKENDS = ("auto", "triton", "reference")
ISA_CLASSES = cpu_isa.CLASSES  # lowest first


@dataclass(frozen=True)
class KernelSettings:
    backend: str = "auto"
    cpu_kernels: bool = True
    packed_gemm: bool = True
    build_dir: Path = Path.home() / ".cache" / "pagedserve" / "kernels"
    isa_cap: str | None = None


_current = KernelSettings()
_backend = _current.backend  # the hot path's copy of _current.backend; set only by configure


def current() -> KernelSettings:
    return _current


def configure(cpu_kernels: bool | None = None, packed_gemm: bool | None = None,
              build_dir: Path | str | None = None, isa_cap: str | None = None,
              clear_cap: bool = False, backend: str | None = None) -> KernelSettings:
    """Change the given switches (``clear_cap``: no ISA cap; a cap is one of ``ISA_CLASSES``,
    checked by whoever reads it from a user; ``backend``: one of ``BACKENDS``, else
    ``ValueError``); returns the new settings."""
    global _current, _backend
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    old = _current
    _current = replace(
        old,
        backend=old.backend if backend is None else backend,
        cpu_kernels=old.cpu_kernels if cpu_kernels is None else cpu_kernels,
        packed_gemm=old.packed_gemm if packed_gemm is None else packed_gemm,
        build_dir=old.build_dir if build_dir is None else Path(build_dir),
        isa_cap=isa_cap if isa_cap is not None or clear_cap else old.isa_cap,
    )
    _backend = _current.backend
    return _current


@contextmanager
def backend(name: str) -> Iterator[None]:
    """Use backend ``name`` inside the block, then restore the previous one."""
    previous = _current.backend
    configure(backend=name)
    try:
        yield
    finally:
        configure(backend=previous)


def use_triton(t: torch.Tensor) -> bool:
    """Whether ``kernels.ops`` runs the Triton kernel for ``t``."""
    if _backend == "triton":
        return True
    return _backend == "auto" and t.is_cuda and HAS_TRITON


def use_cpu(t: torch.Tensor) -> bool:
    """Whether ``kernels.ops`` may run a C kernel for ``t`` (if it takes the tensors)."""
    return _backend == "auto" and t.device.type == "cpu"


def isa_class(flags: frozenset[str] | set[str] | None = None, cap: str | None = None) -> str:
    """This machine's CPU class (or the one of ``flags``), lowered to ``cap`` (default: the
    configured ``isa_cap``)."""
    return cpu_isa.isa_class(flags, cap=_current.isa_cap if cap is None else cap)


def native_bf16(isa: str | None = None) -> bool:
    """Whether bfloat16 arithmetic is native on class ``isa`` (default: this machine's, capped)."""
    return cpu_isa.native_bf16(isa or isa_class())


__all__ = [
    "BACKENDS",
    "FP8",
    "ISA_CLASSES",
    "KernelSettings",
    "backend",
    "configure",
    "current",
    "fp8_capable",
    "isa_class",
    "native_bf16",
    "use_cpu",
    "use_triton",
]
