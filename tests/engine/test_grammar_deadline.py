"""Grammar compiles within a time bound (engine/grammar/deadline_pool.py,
engine/grammar/compiler.py): a job past ``timeout_s`` fails with ``CompileTimeout`` naming the
field and the bound while its thread runs on, the next grammar compiles in its place, at most
``threads`` overrun jobs give their place up, a job that waited too long for a thread fails
too; then the engine with a grammar that xgrammar really takes seconds to compile."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from engine import LLMEngine, SamplingParams, StructuredOutputsParams
from engine.grammar.deadline_pool import CompileTimeout, DeadlinePool
from tests.checkpoints import make_checkpoint

pytest.importorskip("xgrammar")

# xgrammar builds a token mask per position of a sequence of character classes: 6,000 of
# "[^\"\\]" took 2.6 s (5,000) to 10.6 s (10,000) over this test model's 768 tokens and
# 6.9 s for just 200 of them over Qwen2.5's 151,936 (measured on 2 shared cores)
SLOW_GRAMMAR = "root ::= " + '[^"\\\\] ' * 6000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def blocked(gate: threading.Event, result: str, nice: list[int] | None = None):
    """A job that ends when ``gate`` opens, noting then its thread's nice value."""
    def job() -> str:
        gate.wait(30)
        if nice is not None:
            nice.append(os.getpriority(os.PRIO_PROCESS, 0))  # (0: this thread, on Linux)
        return result
    return job


def settle(future: Future) -> None:
    """Let the job's thread finish setting ``future`` (it is done once the gate opens)."""
    future.exception(timeout=10)


def test_an_overrun_job_fails_and_gives_its_thread_to_the_next():
    clock = Clock()
    pool = DeadlinePool(threads=1, timeout_s=2.0, setting="grammar_compile_timeout_s",
                        clock=clock)
    slow_gate, fast_gate = threading.Event(), threading.Event()
    slow_nice: list[int] = []
    fast_nice: list[int] = []
    slow = pool.submit(blocked(slow_gate, "slow", slow_nice), "structured_outputs.grammar")
    fast = pool.submit(blocked(fast_gate, "fast", fast_nice), "structured_outputs.regex")
    fast_gate.set()
    clock.now += 1.9  # slow still has 0.1 s: fast waits for the one thread
    pool.expire()
    assert not slow.done() and not fast.done()
    clock.now += 0.1
    pool.expire()
    error = slow.exception(timeout=0)
    assert isinstance(error, CompileTimeout) and error.started
    assert str(error) == ("structured_outputs.grammar took longer than 2 s to compile "
                          "(grammar_compile_timeout_s); simplify it")
    assert fast.result(timeout=10) == "fast"  # started in slow's place at once
    assert pool.num_overrun == 1
    slow_gate.set()  # the overrun compile ends: its result is dropped
    deadline = time.monotonic() + 10
    while pool.num_overrun and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.num_overrun == 0 and slow.exception(timeout=0) is error
    if sys.platform == "linux":  # the overrun thread ran on at the lowest priority
        assert (slow_nice, fast_nice) == ([19], [os.getpriority(os.PRIO_PROCESS, 0)])


def test_past_the_cap_an_overrun_job_keeps_its_thread_and_the_waiting_one_fails():
    clock = Clock()
    pool = DeadlinePool(threads=1, timeout_s=2.0, setting="grammar_compile_timeout_s",
                        clock=clock)
    gates = [threading.Event() for _ in range(3)]
    first = pool.submit(blocked(gates[0], "a"), "structured_outputs.grammar")
    clock.now += 2.0
    pool.expire()  # first overruns and gives its place up (1 of at most 1)
    second = pool.submit(blocked(gates[1], "b"), "structured_outputs.grammar")
    third = pool.submit(blocked(gates[2], "c"), "structured_outputs.json")
    clock.now += 2.0
    pool.expire()  # second overruns too but keeps its place; third has waited 2 s
    assert [type(f.exception(timeout=0)) for f in (first, second, third)] == [CompileTimeout] * 3
    waited = third.exception(timeout=0)
    assert isinstance(waited, CompileTimeout) and not waited.started
    assert str(waited) == ("structured_outputs.json waited 2 s for one of the 1 compile "
                           "threads (grammar_compile_timeout_s): other grammars are taking "
                           "long to compile; retry later")
    assert pool.num_overrun == 1
    for gate in gates:
        gate.set()


def test_a_job_that_ends_in_time_keeps_its_result_or_its_own_error():
    pool = DeadlinePool(threads=2, timeout_s=60.0, setting="s")
    assert pool.submit(lambda: 7, "x").result(timeout=10) == 7

    def bad() -> None:
        raise ValueError("structured_outputs.grammar could not be compiled: no")
    with pytest.raises(ValueError, match="could not be compiled"):
        pool.submit(bad, "x").result(timeout=10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


def _params(**spec) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(**spec))


def _run(engine: LLMEngine, timeout: float = 60.0) -> dict[str, str]:
    """Step until idle; each finished request's text."""
    texts: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return texts


def test_a_slow_grammar_fails_its_request_and_does_not_hold_up_the_next(ckpt):
    engine = LLMEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20,
                       block_size=8, progress=False, grammar_compile_timeout_s=0.3,
                       grammar_compile_threads=1)
    engine.add_request("warm", [5, 9], _params(regex="w"))  # builds the vocabulary's tables
    assert _run(engine) == {"warm": "w"}
    engine.add_request("slow", [5, 9], _params(grammar=SLOW_GRAMMAR))
    engine.add_request("fast", [5, 9], _params(regex="[a-c]{2}"))
    texts = _run(engine)
    assert list(texts) == ["fast"] and re.fullmatch("[a-c]{2}", texts["fast"])
    assert engine.grammars.pool.num_overrun == 1  # the slow compile still runs, unwaited for
    [(rid, error)] = engine.pop_errors()
    assert rid == "slow" and isinstance(error, ValueError)
    assert str(error) == ("structured_outputs.grammar took longer than 0.3 s to compile "
                          "(grammar_compile_timeout_s); simplify it")
    engine.add_request("again", [5, 9], _params(grammar=SLOW_GRAMMAR))
    assert _run(engine, timeout=0.2) == {}  # failed at once: the overrun is remembered
    assert [rid for rid, _ in engine.pop_errors()] == ["again"]
    assert not engine.has_unfinished()
