"""The tensor-parallel step message: how rank 0 tells ranks 1..N-1 what to run.

Rank 0 lays the batch out and broadcasts it over gloo as two int64 tensors: a header of
``HEADER`` numbers (kind, num_tokens, num_seqs, max_blocks, num_sampled, max_query_len,
max_seq_len), then the body, the batch's arrays end to end (input ids, positions, slot mapping,
block tables, seq lens, query start locations, sampled rows). A header of kind ``EXIT`` ends
the other ranks' loop.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.executor.batch_layout import HostBatch
from engine.layers.context import AttentionMetadata

HEADER = 7
EXIT, STEP = 0, 1


def pack(batch: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: the header and body of ``batch``."""
    b, max_blocks = batch.block_tables.shape
    header = torch.tensor([STEP, len(batch.input_ids), b, max_blocks, len(batch.sample_idx),
                           batch.max_query_len, int(batch.seq_lens.max())])
    body = torch.from_numpy(np.concatenate([
        batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables.ravel(),
        batch.seq_lens, batch.query_start_loc, batch.sample_idx]).astype(np.int64))
    return header, body


def exit_header() -> torch.Tensor:
    return torch.full((HEADER,), EXIT, dtype=torch.long)


def empty_body(header: torch.Tensor) -> torch.Tensor:
    """Ranks 1..N-1: a buffer for the body the header announces."""
    _, t, b, max_blocks, s = header[:5].tolist()
    return torch.empty(3 * t + b * max_blocks + 2 * b + 1 + s, dtype=torch.long)


def unpack(header: torch.Tensor, body: torch.Tensor, device: torch.device,
           ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Every rank: input ids, positions, attention metadata and sampled rows of a message."""
    _, t, b, max_blocks, s, max_query_len, max_seq_len = header.tolist()
    ids, positions, slots, tables, seq_lens, q_starts, sample_idx = torch.split(
        body.to(device), [t, t, t, b * max_blocks, b, b + 1, s])
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(b, max_blocks).int(),
                             seq_lens=seq_lens.int(), query_start_loc=q_starts.int(),
                             max_query_len=max_query_len, max_seq_len=max_seq_len)
    return ids, positions, meta, sample_idx
