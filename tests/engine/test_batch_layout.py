"""``batch_layout.lay_out``: a step's rows, slots and block tables, exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.executor.batch_layout import lay_out


def _request(i: int, prompt: list[int], computed: int, blocks: list[int],
             prompt_logprobs: int | None = None, output: list[int] = ()) -> Request:
    req = Request(f"r{i}", prompt, SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs))
    req.all_token_ids.extend(output)
    req.num_computed_tokens = computed
    req.block_ids = list(blocks)
    return req


def test_decode_rows_and_a_chunk_exactly():
    block = 4
    a = _request(0, [10, 11, 12, 13, 14], 5, [7, 3], output=[15])  # decode at position 5
    b = _request(1, [20, 21, 22, 23, 24, 25, 26], 2, [9, 2])  # chunk of positions 2..5
    c = _request(2, [30, 31], 1, [5])  # the prompt's last token: sampled
    batch = lay_out(SchedulerOutput([(a, 1), (b, 4), (c, 1)]), block)
    assert batch.input_ids.tolist() == [15, 22, 23, 24, 25, 31]
    assert batch.positions.tolist() == [5, 2, 3, 4, 5, 1]
    # slot = block_ids[p // 4] * 4 + p % 4
    assert batch.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 2, 9 * 4 + 3, 2 * 4 + 0,
                                           2 * 4 + 1, 5 * 4 + 1]
    assert batch.block_tables.tolist() == [[7, 3], [9, 2], [5, 0]]
    assert batch.block_tables.dtype == np.int32 and batch.slot_mapping.dtype == np.int64
    assert batch.seq_lens.tolist() == [6, 6, 2]
    assert batch.query_start_loc.tolist() == [0, 1, 5, 6]
    assert batch.max_query_len == 4
    # b's chunk stops short of its prompt's end: no row of it is sampled
    assert batch.sample_idx == [0, 5] and batch.sample_reqs == [a, c]
    assert batch.prompt_rows == []


def _reference(sched: SchedulerOutput, bs: int) -> tuple[list[int], list[int], list[list[int]]]:
    """Positions, slots and padded tables, one token at a time."""
    positions, slots = [], []
    width = max(len(r.block_ids) for r, _ in sched.scheduled)
    tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r, _ in sched.scheduled]
    for req, n in sched.scheduled:
        for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
            positions.append(p)
            slots.append(req.block_ids[p // bs] * bs + p % bs)
    return positions, slots, tables


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 39), st.integers(1, 12),
                          st.booleans()), min_size=1, max_size=12),
       st.sampled_from([1, 4, 16]))
def test_any_mix_of_rows_matches_a_token_by_token_layout(rows, bs):
    scheduled, next_block = [], 1
    for i, (length, computed, n, logprobs) in enumerate(rows):
        computed = min(computed, length - 1)
        n = min(n, length - computed)
        num_blocks = -(-length // bs)
        blocks = list(range(next_block, next_block + num_blocks))[::-1]
        next_block += num_blocks
        req = _request(i, list(range(100, 100 + length)), computed, blocks,
                       prompt_logprobs=1 if logprobs else None)
        scheduled.append((req, n))
    sched = SchedulerOutput(scheduled)
    batch = lay_out(sched, bs)
    positions, slots, tables = _reference(sched, bs)
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.block_tables.tolist() == tables
    assert batch.input_ids.tolist() == [100 + p for p in positions]
    ends = [req.num_computed_tokens + n for req, n in scheduled]
    assert batch.seq_lens.tolist() == ends
    starts = np.cumsum([0] + [n for _, n in scheduled]).tolist()
    assert batch.query_start_loc.tolist() == starts
    sampled = [b for b, (req, _) in enumerate(scheduled) if ends[b] == req.num_tokens]
    assert batch.sample_reqs == [scheduled[b][0] for b in sampled]
    # prompt logprobs: each request's rows for positions p < prompt length - 1, in order
    prompt_idx = [starts[b] + p - req.num_computed_tokens
                  for b, (req, n) in enumerate(scheduled) if req.params.prompt_logprobs
                  for p in range(req.num_computed_tokens,
                                 min(ends[b], req.num_prompt_tokens - 1))]
    assert batch.sample_idx == [starts[b + 1] - 1 for b in sampled] + prompt_idx
