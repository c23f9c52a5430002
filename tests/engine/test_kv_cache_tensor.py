"""The CPU KV cache is zero without being written at start (#53): its pages are the kernel's
zero-filled ones, mapped on first touch."""

from __future__ import annotations

import mmap
import struct
from types import SimpleNamespace

import torch

from engine.executor.kv_cache_tensor import KVCacheTensor

PAGE = mmap.PAGESIZE


def resident_pages(t: torch.Tensor) -> int:
    """Pages of ``t``'s memory the process has mapped (``/proc/self/pagemap``'s present bit)."""
    first = t.data_ptr() // PAGE
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return sum(e >> 63 for e in struct.unpack(f"{len(raw) // 8}Q", raw))


def cache(dtype: torch.dtype = torch.float32, num_blocks: int = 256) -> KVCacheTensor:
    layers = [SimpleNamespace(num_kv_heads=2, head_dim=64) for _ in range(4)]
    kv = KVCacheTensor(layers, block_size=16, dtype=dtype, device=torch.device("cpu"))
    kv.bind(num_blocks)  # 4 layers x 2 x 256 blocks x 16 x 2 x 64 x 4 B = 32 MiB
    return kv


def test_bind_maps_no_page_and_reads_zero() -> None:
    kv = cache()
    t = kv.tensor
    assert t.shape == (4, 2, 256, 16, 2, 64) and t.is_contiguous()
    assert resident_pages(t) == 0  # nothing written at start
    kv.layers[1].k_cache[3].fill_(1.5)  # one block of one layer's keys: 8 KiB, two pages
    assert resident_pages(t) == 2
    assert kv.layers[1].k_cache.data_ptr() == t[1, 0].data_ptr()
    assert torch.count_nonzero(t).item() == 16 * 2 * 64
    assert torch.count_nonzero(t[1, 0, 3] - 1.5).item() == 0


def test_every_element_zero_in_each_cache_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = cache(dtype, num_blocks=8).tensor
        assert t.dtype == dtype and torch.count_nonzero(t).item() == 0


def test_rebind_gives_fresh_zeroed_memory() -> None:
    kv = cache(num_blocks=8)
    kv.tensor.fill_(7.0)
    kv.release()
    kv.bind(8)
    assert torch.count_nonzero(kv.tensor).item() == 0
