"""The one scheduling rule, chunked prefill, prefix hits, preemption and abort, exactly."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=16, max_seqs=8, prefix=False,
         separate=None, on_cpu=False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, prefix)
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             separate_prefill_steps=separate)
    return Scheduler(config, kv, max_model_len=1024, on_cpu=on_cpu)


def req(rid, n, max_tokens=8, start=0):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler, token=7):
    """One step as the engine runs it, every sampled request getting ``token``."""
    out = s.schedule()
    s.finish_step(out)
    for r, _ in out.scheduled:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(token, None)
    return [(r.request_id, n) for r, n in out.scheduled], out


def test_chunked_prefill_under_the_token_budget():
    s = make(budget=8)
    a, b = req("a", 13), req("b", 3)
    s.add(a)
    s.add(b)
    assert step(s)[0] == [("a", 8)]  # the budget is spent on a's first chunk
    assert a.block_ids == [0, 1] and a.num_output_tokens == 0
    assert step(s)[0] == [("a", 5), ("b", 3)]  # a finishes its prompt and samples
    assert a.block_ids == [0, 1, 2, 3] and b.block_ids == [4]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    assert step(s)[0] == [("a", 1), ("b", 1)]  # decode: one token each


def test_sequence_cap():
    s = make(max_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 2))
    assert step(s)[0] == [("r0", 2), ("r1", 2)]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_prefix_hits_count_as_computed():
    s = make(prefix=True)
    a = req("a", 9)
    s.add(a)
    step(s)
    b = req("b", 10)  # shares a's two full blocks
    s.add(b)
    scheduled, _ = step(s)
    assert scheduled == [("a", 1), ("b", 2)]
    assert b.num_cached_tokens == 8 and b.block_ids == [0, 1, 3]


def test_preemption_takes_the_most_recent_request_and_recomputes_it():
    s = make(num_blocks=4, block_size=4, budget=32)
    a, b = req("a", 7, max_tokens=20), req("b", 7, max_tokens=20)
    s.add(a)
    s.add(b)
    assert step(s)[0] == [("a", 7), ("b", 7)]
    assert a.block_ids == [0, 1] and b.block_ids == [2, 3]
    step(s)  # both reach 8 tokens + 1: a needs a third block, none is free
    scheduled, out = step(s)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert scheduled == [("a", 1)]
    assert a.block_ids == [0, 1, 3]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    assert b.num_tokens == 9  # its generated tokens are kept and recomputed as prompt


def test_abort_frees_blocks_anywhere():
    s = make()
    a, b = req("a", 6), req("b", 6)
    s.add(a)
    step(s)
    s.add(b)
    s.abort(a)
    assert a.status == RequestStatus.FINISHED_ABORTED and a.block_ids == []
    s.abort(b)  # still waiting
    assert not s.has_work() and s.kv.num_free_blocks == 16


def test_parallel_sampling_waits_for_the_parent_prompt_then_shares_it():
    s = make(prefix=False)
    params = SamplingParams(n=2, max_tokens=4)
    parent = Request("p#0", list(range(10)), params, index=0, group_id="p")
    child = Request("p#1", list(range(10)), params, index=1, group_id="p")
    child.parent = parent
    s.add(parent)
    s.add(child)
    assert step(s)[0] == [("p#0", 10)]
    scheduled, _ = step(s)
    assert scheduled == [("p#0", 1), ("p#1", 2)]  # the child recomputes the last partial block
    assert child.block_ids[:2] == parent.block_ids[:2] == [0, 1]
    assert s.kv.blocks[0].ref_cnt == 2


def test_separate_prefill_steps_put_new_prompts_before_decodes():
    s = make(budget=8, on_cpu=True)  # the CPU default
    a, b = req("a", 3), req("b", 3)
    s.add(a)
    s.add(b)
    assert step(s)[0] == [("a", 3), ("b", 3)]  # prompts only: nothing decodes yet
    assert step(s)[0] == [("a", 1), ("b", 1)]  # no prompt waits: decode steps
    c, d = req("c", 10), req("d", 2)
    s.add(c)
    s.add(d)
    assert step(s)[0] == [("c", 8)]  # a and b wait one step: c's prompt alone
    assert step(s)[0] == [("a", 1), ("b", 1), ("c", 2), ("d", 2)]  # then a mixed step
    assert step(s)[0] == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    assert [r.num_output_tokens for r in (a, b, c, d)] == [4, 4, 2, 2]


def test_separate_prefill_steps_decode_when_no_prompt_can_start():
    s = make(budget=8, max_seqs=2, separate=True)
    a, b, c = req("a", 2), req("b", 2), req("c", 2)
    for r in (a, b, c):
        s.add(r)
    assert step(s)[0] == [("a", 2), ("b", 2)]
    # c waits for a free slot: never an empty step, the running requests decode every step
    for _ in range(3):
        assert step(s)[0] == [("a", 1), ("b", 1)]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_mixed_steps_when_separate_prefill_steps_is_off():
    for s in (make(budget=8), make(budget=8, on_cpu=True, separate=False)):
        a = req("a", 2)
        s.add(a)
        step(s)
        s.add(req("b", 3))
        assert step(s)[0] == [("a", 1), ("b", 3)]
