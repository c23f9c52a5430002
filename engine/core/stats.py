"""What ``LLMEngine.get_stats`` (``EngineStats``) and ``AsyncEngine.get_stats``
(``AsyncEngineStats``) report."""

from __future__ import annotations

import collections
import time
from typing import TypedDict


class EngineStats(TypedDict):
    num_running: int  # requests (sequences) running in the current step
    num_waiting: int  # queued, not yet admitted (preempted ones included)
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # share of blocks in use, 0..1
    prefix_cache_queries: int  # prompt blocks looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_batched_tokens_total: int  # tokens computed: prefill chunks + decode


class AsyncEngineStats(EngineStats):
    output_tokens_per_s: float  # over the last 10 s of the AsyncEngine's step loop


class StartClock:
    """Seconds an engine's start spent in each named phase (``phases``, in order of first
    mark), and when it began and last marked (wall clock), for the Worker's start-time
    breakdown."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.started_at = time.time()
        self._start = self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """The time since the previous mark (or the clock's start) went to ``phase``."""
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._last, 4)
        self._last = now

    @property
    def last_mark_at(self) -> float:
        """The last mark's wall-clock time (``started_at`` before any)."""
        return self.started_at + (self._last - self._start)


class StepFigures:
    """What ``AsyncEngine``'s loop measures per step: output tokens per second over the last
    ``window_s``, and each step's ``(duration_s, num_batched_tokens)`` until popped (thread-safe:
    the loop thread records, a reader pops; at most ``max_steps`` are kept)."""

    def __init__(self, window_s: float = 10.0, max_steps: int = 4096) -> None:
        self.window_s = window_s
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=max_steps)

    def record(self, start: float, end: float, generated: int, batched: int) -> None:
        """A step from ``start`` to ``end`` (monotonic) generated and computed these tokens."""
        self._rate.append((end, generated))
        if batched:
            self._steps.append((end - start, batched))
        while self._rate and end - self._rate[0][0] > self.window_s:
            self._rate.popleft()

    def output_tokens_per_s(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in list(self._rate) if now - t <= self.window_s) / self.window_s

    def pop_steps(self) -> list[tuple[float, int]]:
        """The steps recorded since the last call, oldest first."""
        steps = self._steps
        return [steps.popleft() for _ in range(len(steps))]
