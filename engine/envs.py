"""Every environment variable pagedserve reads, in one place (listed in the README)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the default model is built: ``PAGEDSERVE_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"


def cpu_isa_cap() -> str | None:
    """``PAGEDSERVE_CPU_ISA``: run as on a CPU of this class at most (``kernels/cpu_isa.py``:
    generic, avx2, avx512, avx512_bf16, amx), to measure a lower class on a higher machine."""
    from kernels.cpu_isa import CLASSES

    value = os.environ.get("PAGEDSERVE_CPU_ISA", "").strip().lower() or None
    if value is not None and value not in CLASSES:
        raise ValueError(f"PAGEDSERVE_CPU_ISA must be one of {', '.join(CLASSES)}, got {value!r}")
    return value
