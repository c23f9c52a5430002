"""The modelled Worker replicas and the Router in front of them.

A replica (a model on one GPU: ``max_num_seqs`` sequence slots, ``kv_tokens`` of KV cache, an
engine step of ``step_base_s + step_per_seq_s * running`` seconds) admits a waiting request when
a slot and KV room for its prompt + output are free, and every running request gains one token
per step. A request's KV room is held from admission to its last token. Decoding is kept as one
counter per replica (tokens each running request has gained since the replica started) and a
heap of the counter values at which its requests finish, so a tick costs O(1) per replica plus
the requests that finish in it (the same arithmetic as decrementing each request, without the
loop over running requests).

The Router holds requests no ready replica can take (before the first replica is up) and hands
each request to the least loaded ready replica, except standby replicas (``Router.route``).
It reports its demand every second (``Router.report``), as the real Router does to each Worker.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

RATE_WINDOW_S = 10.0   # output_tokens_per_s and finished_per_s: the Worker's 10 s window
DEMAND_WINDOW_S = 2.0  # the Router's arrivals and prompt tokens: its last 2 s
DEMAND_PERIOD_S = 1.0  # the Router reports every second


@dataclass(eq=False)
class Req:
    arrival: float
    prompt: int
    output: int
    start: float | None = None  # admission (a sequence slot and KV room)

    @property
    def footprint(self) -> int:
        return self.prompt + self.output


@dataclass(eq=False)
class Replica:
    rid: Any
    index: int          # creation order: the Router's "when it first saw it"
    ready_at: float
    hw: SimpleNamespace
    stopping: bool = False
    waiting: deque = field(default_factory=deque)
    running: int = 0
    kv_used: int = 0
    progress: float = 0.0  # tokens each running request has gained since the replica started
    finishing: list = field(default_factory=list)  # heap of (progress at its end, footprint)
    tokens: float = 0.0     # generated, ever
    finished: int = 0       # requests finished, ever
    rates: deque = field(default_factory=deque)    # (t, tokens, finished) for the 10 s rates
    samples: deque = field(default_factory=deque)  # (t, *metric values) as the Worker reports

    def load(self) -> int:
        return len(self.waiting) + self.running

    def kv_usage(self) -> float:
        return self.kv_used / self.hw.kv_tokens

    def admit(self, now: float) -> None:
        hw = self.hw
        while self.waiting and self.running < hw.max_num_seqs:
            r = self.waiting[0]
            if self.kv_used + r.footprint > hw.kv_tokens and self.running:
                return
            self.waiting.popleft()
            r.start = now
            self.kv_used += r.footprint
            self.running += 1
            heapq.heappush(self.finishing, (self.progress + r.output, r.footprint))

    def step(self, dt: float) -> None:
        n = self.running
        if not n:
            return
        per_req = dt / (self.hw.step_base_s + self.hw.step_per_seq_s * n)
        self.progress += per_req
        self.tokens += per_req * n
        heap = self.finishing
        while heap and heap[0][0] <= self.progress:
            self.kv_used -= heapq.heappop(heap)[1]
            self.running -= 1
            self.finished += 1

    def rate_now(self, now: float) -> tuple[float, float]:
        """(output tokens/s, finished requests/s) over the last ``RATE_WINDOW_S``."""
        self.rates.append((now, self.tokens, self.finished))
        while len(self.rates) > 1 and self.rates[1][0] <= now - RATE_WINDOW_S:
            self.rates.popleft()
        t0, tok0, fin0 = self.rates[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        return (self.tokens - tok0) / span, (self.finished - fin0) / span

    def record(self, now: float, demand: tuple[float, float, float], keep_s: float) -> None:
        """One report, in ``sim.METRICS`` order."""
        tps, fps = self.rate_now(now)
        self.samples.append((now, float(len(self.waiting)), float(self.running), self.kv_usage(),
                             self.running / self.hw.max_num_seqs, tps, fps, *demand))
        while self.samples and self.samples[0][0] < now - keep_s:
            self.samples.popleft()


class Router:
    """The Router tier (one Router: the sums over Routers are the same thing here)."""

    def __init__(self, standby: int = 0, full_queue: float = float("inf"),
                 full_kv: float = float("inf")) -> None:
        self.queue: deque[Req] = deque()
        self.standby, self.full_queue, self.full_kv = standby, full_queue, full_kv
        self.recent: deque[tuple[float, int]] = deque()  # (arrival, prompt) in the last 2 s
        self.demand = (0.0, 0.0, 0.0)  # the latest report
        self.next_report = 0.0

    def accept(self, r: Req) -> None:
        self.queue.append(r)
        self.recent.append((r.arrival, r.prompt))

    def report(self, now: float) -> None:
        """Every ``DEMAND_PERIOD_S``: arrivals/s and prompt tokens/s over the last 2 s, and the
        requests it holds (``demand_arrivals_per_s``, ``..._prompt_tokens_per_s``,
        ``demand_router_waiting``). Called after routing, so ``waiting`` is what no replica
        could take."""
        if now < self.next_report:
            return
        self.next_report += DEMAND_PERIOD_S
        while self.recent and self.recent[0][0] <= now - DEMAND_WINDOW_S:
            self.recent.popleft()
        self.demand = (len(self.recent) / DEMAND_WINDOW_S,
                       sum(p for _, p in self.recent) / DEMAND_WINDOW_S, float(len(self.queue)))

    def route(self, ready: list[Replica]) -> None:
        """Hand every held request to a ready replica (``ready`` in creation order).

        The youngest ``standby`` ready replicas that hold no request are standby: a request goes
        to one only when every other ready replica is full (its queue >= ``full_queue`` or its
        KV use >= ``full_kv``), and that promotes it (it then holds a request). Otherwise the
        least loaded of the others takes it."""
        while self.queue and ready:
            target = self._pick(ready)
            target.waiting.append(self.queue.popleft())

    def _pick(self, ready: list[Replica]) -> Replica:
        if not self.standby:
            return min(ready, key=Replica.load)
        idle = [r for r in ready if not r.load()]
        standby = set(idle[-self.standby:])
        active = [r for r in ready if r not in standby]
        if standby and all(self._full(r) for r in active):
            return min(standby, key=lambda r: r.index)  # promote the oldest standby
        return min(active, key=Replica.load)

    def _full(self, r: Replica) -> bool:
        return len(r.waiting) >= self.full_queue or r.kv_usage() >= self.full_kv
