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

import dataclasses
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
    changes: dict[str, object] = {}
    if cpu_kernels is not None:
        changes["cpu_kernels"] = cpu_kernels
    if packed_gemm is not None:
        changes["packed_gemm"] = packed_gemm
    if build_dir is not None:
        changes["build_dir"] = Path(build_dir)
    if isa_cap is not None or clear_cap:
        changes["isa_cap"] = isa_cap
    _current = dataclasses.replace(_current, **changes)  # type: ignore[arg-type]
    return _current
