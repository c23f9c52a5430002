"""Kernel tests: the Triton kernels against their torch references.

Without a CUDA device the kernels run through Triton's CPU interpreter. TRITON_INTERPRET must be
set before a kernel is decorated, so if another test directory imported `kernels` first, the
kernel modules are reloaded here (in dependency order) to pick the interpreter up.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_KERNEL_MODULES = (
    "kernels._triton",
    "kernels.attention_tile",
    "kernels.rms_norm",
    "kernels.activation",
    "kernels.rotary",
    "kernels.kv_cache",
    "kernels.paged_attention",
    "kernels.paged_attention_split",
    "kernels.ops",
)


def _reload_kernels_for_interpreter() -> None:
    tile = sys.modules.get("kernels.attention_tile")
    if tile is None or type(tile.attend_range).__name__ == "InterpretedFunction":
        return
    for name in _KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _reload_kernels_for_interpreter()

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
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
