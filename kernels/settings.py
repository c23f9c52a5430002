"""The switches of the CPU kernels, set by their user (the engine's model runner, from its
config's device section); ``kernels`` reads no environment variable of this project's, only
the tools' own (``CC``, ``TRITON_INTERPRET``).

| field | meaning | default |
|---|---|---|
| ``cpu_kernels`` | use the C kernels (else the torch references) | on |
| ``packed_gemm`` | prepack CPU linear weights for oneDNN | on |
| ``build_dir`` | where the C kernels are built | ``~/.cache/pagedserve/kernels`` |
| ``isa_cap`` | build and choose as on a CPU of this class at most (``cpu_isa.CLASSES``) | none |
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class KernelSettings:
    cpu_kernels: bool = True
    packed_gemm: bool = True
    build_dir: Path = Path.home() / ".cache" / "pagedserve" / "kernels"
    isa_cap: str | None = None


_current = KernelSettings()


def current() -> KernelSettings:
    return _current


def configure(cpu_kernels: bool | None = None, packed_gemm: bool | None = None,
              build_dir: Path | str | None = None, isa_cap: str | None = None,
              clear_cap: bool = False) -> KernelSettings:
    """Change the given switches (``clear_cap``: no ISA cap; a cap is one of
    ``cpu_isa.CLASSES``, checked by whoever reads it from a user); returns the new settings."""
    global _current
    old = _current
    _current = KernelSettings(
        cpu_kernels=old.cpu_kernels if cpu_kernels is None else cpu_kernels,
        packed_gemm=old.packed_gemm if packed_gemm is None else packed_gemm,
        build_dir=old.build_dir if build_dir is None else Path(build_dir),
        isa_cap=isa_cap if isa_cap is not None or clear_cap else old.isa_cap,
    )
    return _current
