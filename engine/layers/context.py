"""Per-step attention metadata, set around the forward pass so that ``forward(input_ids,
positions)`` stays simple and every attention layer reads the same batch description."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token, -1 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    query_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens of the new tokens
    max_query_len: int
    max_seq_len: int


_CONTEXT: AttentionMetadata | None = None


def get_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside engine.layers.context.set_context")
    return _CONTEXT


@contextmanager
def set_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _CONTEXT
    _CONTEXT = meta
    try:
        yield meta
    finally:
        _CONTEXT = None
