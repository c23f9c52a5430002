"""The KV cache's memory (the block bookkeeping is ``kv_cache_manager.py``'s): its size, the
tensor, and each attention layer's views of it.

One tensor ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; layer ``l``
holds ``k_cache = kv[l, 0]`` and ``v_cache = kv[l, 1]``, each contiguous, so one block of one
layer's keys is one run of memory (gathers on the CPU copy whole blocks). Sized from
``kv_cache_memory_bytes`` (CPU default 1 GiB) or, on CUDA, from measured free memory and
``gpu_memory_utilization`` after a profiling forward.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.config import CacheConfig
from engine.distributed import all_reduce_min
from kernels.settings import FP8, fp8_capable

if TYPE_CHECKING:
    from engine.layers.attention import Attention

DEFAULT_CPU_KV_BYTES = 1 << 30


def kv_budget_bytes(cache: CacheConfig, device: torch.device,
                    profile_forward: Callable[[], None],
                    profile_graphs: Callable[[], None] | None = None) -> int:
    """The bytes the cache may take: ``kv_cache_memory_bytes`` when set; on the CPU 1 GiB; on
    CUDA what is left of ``gpu_memory_utilization`` of the device after what is in use (the
    weights, and NCCL's buffers, allocated when its group started), the activation peak of
    ``profile_forward`` (a forward over a full token budget and the heaviest sampling of its
    logits) and, with CUDA graphs, the pool they will keep: the peak of ``profile_graphs`` (the
    largest captured batch's forward)."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type != "cuda":
        return DEFAULT_CPU_KV_BYTES
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    profile_forward()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    graph_pool = 0
    if profile_graphs is not None:
        torch.cuda.reset_peak_memory_stats()
        profile_graphs()
        graph_pool = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        torch.cuda.empty_cache()
    return int(total * cache.gpu_memory_utilization - (total - free) - activation_peak
               - graph_pool)


def kv_cache_dtype(cache: CacheConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's element type: ``dtype`` for "auto", else fp8 E4M3; ``ValueError`` on a GPU
    without fp8 (compute capability below 8.9, where Triton has no E4M3 type)."""
    if cache.kv_cache_dtype == "auto":
        return dtype
    if not fp8_capable(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"kv_cache_dtype={cache.kv_cache_dtype!r} needs a GPU of compute "
                         f"capability 8.9 or newer (Ada, Hopper); this one is {major}.{minor}: "
                         "use kv_cache_dtype='auto'")
    return FP8


class KVCacheTensor:
    def __init__(self, attn_layers: Sequence[Attention], block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layers = list(attn_layers)
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.tensor: torch.Tensor | None = None

    def bytes_per_block(self) -> int:
        """One block of every layer's keys and values."""
        attn = self.layers[0]
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_dim
        return per_layer * len(self.layers) * self.dtype.itemsize

    def bind(self, num_blocks: int) -> None:
        """A zeroed cache of ``num_blocks`` blocks, viewed by every layer."""
        attn = self.layers[0]
        shape = (len(self.layers), 2, num_blocks, self.block_size, attn.num_kv_heads,
                 attn.head_dim)
        self.tensor = (zeroed_pages(shape, self.dtype) if self.device.type == "cpu" else
                       torch.zeros(shape, dtype=self.dtype, device=self.device))
        for i, layer in enumerate(self.layers):
            layer.k_cache = self.tensor[i, 0]
            layer.v_cache = self.tensor[i, 1]

    def release(self) -> None:
        self.tensor = None

    def allocate(self, budget_bytes: int, max_model_len: int) -> int:
        """Bind as many blocks as ``budget_bytes`` holds (the smallest over the ranks); returns
        the count. ``ValueError`` when one ``max_model_len`` sequence does not fit."""
        per_block = self.bytes_per_block()
        num_blocks = all_reduce_min(budget_bytes // per_block, self.device)
        needed_blocks = -(-max_model_len // self.block_size)
        if num_blocks < needed_blocks:
            raise ValueError(
                f"KV cache too small: {max(num_blocks, 0)} blocks of {self.block_size} tokens "
                f"hold fewer than max_model_len={max_model_len} tokens; one sequence needs "
                f"{needed_blocks * per_block} bytes (kv_cache_memory_bytes or "
                "gpu_memory_utilization), or lower max_model_len")
        self.bind(num_blocks)
        return num_blocks


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in fresh anonymous memory: the kernel maps its pages zero-filled on
    first touch, so the cache is zero as ``torch.zeros`` makes it, but its start does not write
    the whole budget (0.5-5 s for 1 GiB on a loaded 2-core machine, #53) and a Worker's memory
    grows with the blocks it uses. Not the allocator's: with ``keep_freed_memory`` malloc reuses
    freed memory, which holds old values."""
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor keeps ``pages``

