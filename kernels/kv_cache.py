"""Store the new tokens' keys and values into the paged KV cache through the slot mapping.

slot = block_id * block_size + offset; slot -1 marks a padding token that is skipped.
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton  # noqa: F401  (kernel added next)


def store_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hk, D] -> k_cache/v_cache [num_blocks, block_size, Hk, D] (views allowed)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)
