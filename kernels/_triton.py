"""Guarded Triton import shared by the kernel files.

CPU installs of the runtime may lack Triton; the kernel files must still import so that their
pure-torch references (``*_ref``) stay usable. Without Triton, ``triton.jit`` returns a stub that
raises when launched, and ``tl.constexpr`` is a placeholder used only in kernel signatures.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on installs without Triton
    HAS_TRITON = False

    def _missing_jit(fn: Any = None, **_: Any) -> Any:
        def wrap(f: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"{f.__name__}: Triton is not installed")

            return _Launchable(launch)

        return wrap(fn) if fn is not None else wrap

    class _Launchable:
        def __init__(self, launch: Any) -> None:
            self._launch = launch

        def __getitem__(self, grid: Any) -> Any:
            return self._launch

    triton = SimpleNamespace(jit=_missing_jit, cdiv=lambda a, b: -(-a // b))
    tl = SimpleNamespace(constexpr=Any)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


__all__ = ["HAS_TRITON", "interpreting", "next_power_of_2", "tl", "triton"]
