"""Every environment variable pagedserve reads, in one place (listed in the README), read once
into a frozen ``Settings``.

The CPU kernel switches are the defaults of the engine config's device section
(``DeviceConfig.cpu_kernels``, ``cpu_packed_gemm``, ``kernel_build_dir``), so a Serve config can
set them too; ``configure_kernels`` hands a device section's values to ``kernels.settings``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kernels.settings import ISA_CLASSES


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # PAGEDSERVE_CACHE_DIR, else $XDG_CACHE_HOME/pagedserve, ~/.cache/pagedserve
    cpu_isa: str | None  # PAGEDSERVE_CPU_ISA: run as on a CPU of this class at most
    cpu_kernels: bool  # PAGEDSERVE_CPU_KERNELS=0: the torch references instead of the C kernels
    cpu_packed_gemm: bool  # PAGEDSERVE_CPU_PACKED_GEMM=0: plain F.linear on the CPU
    cpu_malloc_reuse: bool  # PAGEDSERVE_CPU_MALLOC=default: leave glibc's allocator alone

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        """``ValueError`` naming a variable whose value is not accepted."""
        explicit = environ.get("PAGEDSERVE_CACHE_DIR")
        xdg = environ.get("XDG_CACHE_HOME")
        cache = (Path(explicit) if explicit
                 else (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve")
        isa = environ.get("PAGEDSERVE_CPU_ISA", "").strip().lower() or None
        if isa is not None and isa not in ISA_CLASSES:
            raise ValueError(f"PAGEDSERVE_CPU_ISA must be one of {', '.join(ISA_CLASSES)}, "
                             f"got {isa!r}")
        return cls(cache_dir=cache, cpu_isa=isa,
                   cpu_kernels=environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0",
                   cpu_packed_gemm=environ.get("PAGEDSERVE_CPU_PACKED_GEMM", "1") != "0",
                   cpu_malloc_reuse=environ.get("PAGEDSERVE_CPU_MALLOC", "reuse") != "default")


_settings: Settings | None = None


def settings() -> Settings:
    """This process's settings, read from the environment on first use."""
    global _settings
    if _settings is None:
        _settings = Settings.from_environ(os.environ)
    return _settings


def reload() -> Settings:
    """Read the environment again (tests that change it)."""
    global _settings
    _settings = None
    return settings()


def cache_dir() -> Path:
    """Where the default model (and, by default, the CPU kernels) are built."""
    return settings().cache_dir
