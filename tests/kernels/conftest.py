"""Kernel tests: the Triton kernels against their torch references.

Without a CUDA device the kernels run through Triton's CPU interpreter. TRITON_INTERPRET must be
set before Triton is imported; `kernels` imports Triton only at a kernel's first launch, so
importing the engine first is fine, but if something else imported Triton already, the CPU
variants are skipped with the reason (set TRITON_INTERPRET=1 in the environment to avoid it).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _triton_imported_compiled() -> bool:
    """Triton was imported before TRITON_INTERPRET was set: its own jit helpers are compiled."""
    language = sys.modules.get("triton.language")
    return language is not None and type(language.sum).__name__ != "InterpretedFunction"


_STALE_TRITON = _triton_imported_compiled()

from kernels._triton import HAS_TRITON, interpreting  # noqa: E402

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where the Triton kernels run: the CPU interpreter, or natively on CUDA (`-m gpu`)."""
    if not HAS_TRITON:
        pytest.skip("Triton is not installed")
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if request.param == "cpu" and not interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1 (set when no CUDA device)")
    if request.param == "cpu" and _STALE_TRITON:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set; export it to run these")
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
