"""A step's flat batch on the host: every scheduled request's new tokens laid end to end.

``input_ids`` and ``positions`` ``[T]``, the cache ``slot_mapping`` ``[T]``, ``block_tables``
``[B, max_blocks]``, ``seq_lens`` and ``query_start_loc`` (cu_seqlens of the queries). Logits are
computed only for the last token of requests whose new tokens reach the end of their sequence:
``sample_idx`` are those rows, ``sample_reqs`` their requests. A request that asks for prompt
logprobs also gets the rows of its prompt positions not yet scored, after the sampled rows:
``prompt_rows`` says whose and how many, in order.
"""

from __future__ import annotations

from itertools import chain
from typing import NamedTuple

import numpy as np

from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput


class HostBatch(NamedTuple):
    """One step laid out on the host, before it goes to the device."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: np.ndarray  # [B] int32
    query_start_loc: np.ndarray  # [B + 1] int32
    max_query_len: int
    sample_idx: list[int]  # rows of the hidden states that get logits
    sample_reqs: list[Request]
    prompt_rows: list[tuple[Request, int]]  # rows after the sampled ones: prompt logprobs


def lay_out(sched: SchedulerOutput, block_size: int) -> HostBatch:
    """``sched``'s new tokens as one flat batch. Per request only list appends; the block
    tables and the slots are numpy over the whole batch (per-row numpy calls cost ~8 us a row,
    2 ms a step at 256 sequences)."""
    scheduled = sched.scheduled
    ids: list[int] = []
    positions: list[int] = []
    seq_lens, q_starts = [], [0]
    sample_idx: list[int] = []
    sample_reqs: list[Request] = []
    prompt_idx: list[int] = []
    prompt_rows: list[tuple[Request, int]] = []
    for req, n in scheduled:
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        ids.extend(req.all_token_ids[start:end])
        positions.extend(range(start, end))
        seq_lens.append(end)
        q_starts.append(q_starts[-1] + n)
        if end == req.num_tokens:
            sample_idx.append(q_starts[-1] - 1)
            sample_reqs.append(req)
        if req.prompt_logprobs:  # position p scores prompt token p + 1
            first = max(start, len(req.prompt_logprobs) - 1)
            rows = range(first, min(end, req.num_prompt_tokens - 1))
            prompt_idx.extend(q_starts[-2] + p - start for p in rows)
            if rows:
                prompt_rows.append((req, len(rows)))
    tables, pos = _block_tables(scheduled), np.array(positions, dtype=np.int64)
    token_rows = np.repeat(np.arange(len(scheduled)), [n for _, n in scheduled])
    slots = tables[token_rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return HostBatch(np.array(ids, dtype=np.int64), pos, slots, tables,
                     np.array(seq_lens, dtype=np.int32), np.array(q_starts, dtype=np.int32),
                     max(n for _, n in scheduled), sample_idx + prompt_idx, sample_reqs,
                     prompt_rows)


def _block_tables(scheduled: list[tuple[Request, int]]) -> np.ndarray:
    """Each request's block ids as a row, padded with 0 to the longest."""
    lens = np.array([len(req.block_ids) for req, _ in scheduled])
    tables = np.zeros((len(scheduled), int(lens.max())), dtype=np.int32)
    tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
        chain.from_iterable(req.block_ids for req, _ in scheduled), np.int32, int(lens.sum()))
    return tables
