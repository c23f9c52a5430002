"""Continuous batching under one rule: each step, every request's computed tokens catch up
toward its total tokens, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``).

Running requests are served first, in arrival order; when the cache runs out of blocks the most
recently admitted running request is preempted (its blocks freed; it is recomputed later). Then
waiting requests are admitted in order, their prefix-cache hits counted as computed. A prompt
longer than the budget is simply computed over several steps (chunked prefill).

With ``separate_prefill_steps`` (the default on CPUs), a step that follows a mixed step skips the
running requests' decode tokens whenever prompt tokens wait: a new request's first token then
costs a step of prompt tokens only, not a step of prompt and decode tokens. Decodes still run
every other step at least, and a step that could start no prompt decodes instead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.grammar.compiler import Grammars


@dataclass
class SchedulerOutput:
    """The requests of one step and how many new tokens each computes, in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 on_cpu: bool = False) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        separate = config.separate_prefill_steps
        self.separate_prefill_steps = on_cpu if separate is None else separate
        self._last_prefill_only = False
        self.max_model_len = max_model_len
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queues
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request) -> None:
        """Remove ``req`` wherever it is and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        if not req.finished:
            req.status = RequestStatus.FINISHED_ABORTED

    # ----------------------------------------------------------------- the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefill_only = (self.separate_prefill_steps and not self._last_prefill_only
                        and self._has_prefill_work())
        budget = self._extend_running(out, self.max_num_batched_tokens, prefill_only)
        if not out.preempted:
            self._admit_waiting(out, budget)
        if prefill_only and not out.scheduled and not out.preempted:
            prefill_only = False  # no prompt could start (no free slot or block): decode now
            self._extend_running(out, self.max_num_batched_tokens, False)
        self._last_prefill_only = prefill_only
        return out

    def _has_prefill_work(self) -> bool:
        return bool(self.waiting) or any(r.num_tokens - r.num_computed_tokens > 1
                                         for r in self.running)

    def _extend_running(self, out: SchedulerOutput, budget: int, prefill_only: bool) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if prefill_only and n <= 1:  # a decode: it runs in the next step
                i += 1
                continue
            while not self.kv.allocate_slots(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if req.grammar is not None and not req.grammar.ready:
                skipped.append(req)  # its grammar is still compiling (or failed: the engine
                continue              # fails the request)
            if req.parent is not None and not req.block_ids and not self._fork(req):
                skipped.append(req)  # waits to share its parent's prompt blocks
                continue
            hits = [] if req.block_ids else self.kv.get_computed_blocks(req)
            computed = req.num_computed_tokens + len(hits) * self.kv.block_size
            n = min(req.num_tokens - computed, budget)
            if not self.kv.allocate_slots(req, computed + n, hits):
                self.waiting.appendleft(req)
                break
            if hits:
                req.num_computed_tokens = req.num_cached_tokens = computed
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def failed_grammars(self) -> list[tuple[Request, Exception]]:
        """Waiting requests whose grammar failed to compile, with the errors."""
        return [(r, e) for r in self.waiting
                if r.grammar is not None and (e := r.grammar.error) is not None]

    def wait_for_grammars(self, timeout: float) -> None:
        """Block until a waiting request's grammar is compiled, at most ``timeout`` s."""
        Grammars.wait_any([r.grammar for r in self.waiting if r.grammar is not None], timeout)

    def _fork(self, req: Request) -> bool:
        parent = req.parent
        assert parent is not None
        if parent.num_computed_tokens < parent.num_prompt_tokens and not parent.finished:
            return False
        if not parent.finished:
            self.kv.fork(parent, req)
        req.parent = None
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # ----------------------------------------------------------------- after the model ran
    def finish_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and register the newly full blocks in the prefix cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.kv.cache_blocks(req)

    def free_finished(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        self.kv.free(req)
