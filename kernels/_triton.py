"""Lazy Triton: the kernel files import without Triton, and Triton is imported at first launch.

Two reasons. CPU installs of the runtime may lack Triton, yet the kernel files must import so
that their pure-torch references (``*_ref``) stay usable. And Triton decides at import and
decoration time whether to run kernels through its CPU interpreter (``TRITON_INTERPRET=1``), so
importing `kernels` (as the engine does) must not import Triton before a test has set that up.

``@triton.jit`` here returns a `LazyJIT`; its first launch (``kernel[grid](...)``) imports Triton,
decorates the function for real and rebinds ``triton``, ``tl`` and every other `LazyJIT` in the
kernel's module to the real objects, so the Triton compiler sees a normal module. Kernel files
use ``from __future__ import annotations`` so that ``tl.constexpr`` annotations stay strings.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any, overload

HAS_TRITON = importlib.util.find_spec("triton") is not None


class _LazyModule:
    """Stands in for a module; attribute access imports it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if not HAS_TRITON:
            raise RuntimeError(f"{self._name}.{attr}: Triton is not installed")
        return getattr(importlib.import_module(self._name), attr)


class LazyJIT:
    """A @triton.jit function whose decoration waits for its first launch."""

    def __init__(self, fn: Any, kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.kwargs = kwargs
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._kernel: Any = None

    def materialize(self) -> Any:
        if self._kernel is None:
            if not HAS_TRITON:
                raise RuntimeError(f"{self.fn.__name__}: Triton is not installed")
            import triton as real_triton

            self._kernel = real_triton.jit(self.fn, **self.kwargs)
            _bind_module(self.fn.__globals__)
        return self._kernel

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        launcher: Callable[..., Any] = self.materialize()[grid]
        return launcher

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.fn.__name__} is a Triton function: launch it as kernel[grid](...)")


def _bind_module(namespace: dict[str, Any]) -> None:
    """Replace the lazy stand-ins in a kernel module's globals with the real Triton objects."""
    import triton as real_triton
    import triton.language as real_tl

    if namespace.get("triton") is triton:
        namespace["triton"] = real_triton
    if namespace.get("tl") is tl:
        namespace["tl"] = real_tl
    for name, value in list(namespace.items()):
        if isinstance(value, LazyJIT):
            namespace[name] = value.materialize()


class _LazyTriton(_LazyModule):
    """``triton`` with a typed ``jit``: a kernel is a `LazyJIT`, launched as ``kernel[grid]``."""

    @overload
    @staticmethod
    def jit(fn: Callable[..., Any]) -> LazyJIT: ...

    @overload
    @staticmethod
    def jit(fn: None = None, **kwargs: Any) -> Callable[[Callable[..., Any]], LazyJIT]: ...

    @staticmethod
    def jit(
        fn: Callable[..., Any] | None = None, **kwargs: Any
    ) -> LazyJIT | Callable[[Callable[..., Any]], LazyJIT]:
        if fn is None:
            return lambda f: LazyJIT(f, kwargs)
        return LazyJIT(fn, kwargs)


triton: _LazyTriton = _LazyTriton("triton")
tl: Any = _LazyModule("triton.language")


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(n, 1) - 1).bit_length()


__all__ = ["HAS_TRITON", "LazyJIT", "cdiv", "interpreting", "next_power_of_2", "tl", "triton"]
