"""Process settings for running the model on the CPU.

glibc serves allocations above 32 MiB (a prefill chunk's MLP activations are 40 MiB) with fresh
``mmap`` pages and unmaps them on free, so every prefill step page-faults its activations in
again: about 11 ms per 40 MiB, a tenth of a 2048-token step of a 0.5B model. ``keep_freed_memory``
tells glibc to serve every allocation from its heap and not to hand freed memory back to the
system, so activation buffers are reused across steps (what tcmalloc or jemalloc would do). The
process keeps its peak activation memory. ``PAGEDSERVE_CPU_MALLOC=default`` leaves glibc alone.
"""

from __future__ import annotations

import ctypes
import logging

from engine import envs

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_done = False


def keep_freed_memory() -> bool:
    """Apply the glibc settings once per process; False where they do not apply."""
    global _done
    if _done:
        return True
    if not envs.settings().cpu_malloc_reuse:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok: bool = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):  # not glibc
        return False
    if not ok:
        logger.warning("mallopt refused the CPU allocator settings; leaving them as they are")
    _done = ok
    return ok
