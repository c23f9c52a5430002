"""The Router's admission: 429 when the waiting queue is full, or when a new request's predicted
wait for its first token would break ``ttft_slo_s``.

Always: the hard cap. A request whose sequences (a prompt with ``n`` choices is ``n``) would take
the Router's waiting queue (accepted, no first token yet) over ``max_waiting_requests`` gets
429 with ``Retry-After`` = the Router's mean time to first token (ceil, at least 1 s).

With ``ttft_slo_s`` set, each request's wait is also predicted when it arrives::

    predicted = start_remaining_s + ahead / drain_per_s

* ``ahead``: sequences queued before it: this Router's own not handed to a Worker yet, and the
  Workers' reported waiting queues (their routing stats).
* ``drain_per_s``: how fast that queue empties: the Workers' finished requests per second,
  summed (routing stats; a sequence slot frees when a request finishes, so under load it is the
  rate at which waiting requests are admitted). With none measured the queue term is 0: without
  evidence nothing is shed, and the hard cap still holds.
* ``start_remaining_s``: while no Worker runs (scaled to zero, one starting), the start still
  to go: the policy's ``replica_start_s`` less the time since this Router began waiting for one.

A prediction over the SLO is a 429 whose ``Retry-After`` is the time until the predicted wait
falls to the SLO, draining as now with nothing new arriving: ``ceil(predicted - slo)``, at
least 1 s. While a Worker starts and the prediction meets the SLO, the Router holds the request
until the Worker runs (``WorkerReadiness._wait_for_worker``). The prediction leaves out the prefill time
itself: it is the queue's share of the TTFT.

The Workers' stats and the clock are injectable, so the decisions are tested on a scripted
wait.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from serve_app.cluster import registry
from serve_app.protocol.errors import APIError
from serve_app.router.demand import unrouted

Clock = Callable[[], float]


class Rejected(APIError):
    """A 429 from admission; ``cause`` labels it in the Router's rejection counter."""

    def __init__(self, cause: str, message: str, retry_after_s: int) -> None:
        super().__init__(429, message, headers={"Retry-After": str(retry_after_s)})
        self.cause = cause
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QueueView:
    """What a Router sees of the queue a new request would join."""

    own_waiting: int  # sequences this Router accepted and has not handed to a Worker
    worker_waiting: int  # the Workers' reported waiting sequences, summed
    drain_per_s: float  # the Workers' finished requests per second, summed

    @classmethod
    def of(cls, own_waiting: int, routing_stats: Iterable[dict[str, Any]]) -> QueueView:
        """From this Router's waiting count and the Workers' last routing stats."""
        stats = list(routing_stats)
        return cls(own_waiting, sum(int(s.get("num_waiting", 0)) for s in stats),
                   sum(float(s.get("finished_per_s", 0.0)) for s in stats))

    def wait_s(self) -> float:
        """The queue's share of a new request's wait: 0 with nothing ahead or no rate."""
        ahead = self.own_waiting + self.worker_waiting
        return ahead / self.drain_per_s if ahead and self.drain_per_s > 0 else 0.0


def retry_after(predicted_s: float, slo_s: float) -> int:
    """Seconds until a predicted wait of ``predicted_s`` falls to ``slo_s`` (ceil, >= 1)."""
    return max(1, math.ceil(predicted_s - slo_s))


def waiting_for_first_token(active: Iterable[Any]) -> int:
    """Sequences of ``active`` (the Router's ``EngineRequest``s) accepted without a first token
    yet (a prompt with ``n`` choices is n)."""
    return sum(r.params.n for r in active if r.first_output_at is None and not r.finished)


class Admission:
    """One Router replica's admission (see the module docstring)."""

    def __init__(self, max_waiting: int, ttft_slo_s: float | None, replica_start_s: float,
                 active: Collection[Any],
                 routing_stats: Callable[[], Iterable[dict[str, Any]]] = registry.routing_stats,
                 clock: Clock = time.monotonic) -> None:
        """``active``: the Router's live ``EngineRequest``s (read, never changed);
        ``routing_stats``: the running Workers' last routing stats."""
        self.max_waiting = max_waiting
        self.slo_s = ttft_slo_s
        self.start_s = replica_start_s
        self._active = active
        self._routing_stats = routing_stats
        self._clock = clock
        self._starting_since: float | None = None  # no Worker ran when a request came then

    @classmethod
    def for_router(cls, cfg: Any, active: Collection[Any]) -> Admission:
        """From an ``AppConfig``: its bound, its SLO, its autoscaling policy's start time."""
        start_s = cfg.autoscaling.replica_start_s if cfg.autoscaling is not None else 0.0
        return cls(cfg.max_waiting_requests, cfg.ttft_slo_s, start_s, active)

    def num_waiting(self) -> int:
        """Sequences this Router accepted without a first token yet."""
        return waiting_for_first_token(self._active)

    def view(self) -> QueueView:
        return QueueView.of(unrouted(self._active), self._routing_stats())

    def admit(self, num_seqs: int | None, mean_ttft_s: float) -> None:
        """Admit ``num_seqs`` more sequences, or raise ``Rejected``: the hard cap first, then
        (with the SLO) the predicted wait. None: a request to hold while a Worker starts."""
        if num_seqs is None:
            self._hold_or_shed()
            return
        waiting = self.num_waiting()
        if waiting + num_seqs > self.max_waiting:
            retry = max(1, math.ceil(mean_ttft_s))
            raise Rejected("queue_full", f"the server is busy ({waiting} requests waiting); "
                           f"retry after {retry}s", retry)
        if self.slo_s is not None:
            self._starting_since = None  # a Worker runs (the Router checked before admitting)
            self._check(self.view().wait_s(), self.slo_s)

    def _hold_or_shed(self) -> None:
        """No Worker runs and one is starting: return to hold the request until it runs, or
        raise ``Rejected`` when the start still to go (and what waits) breaks the SLO."""
        if self.slo_s is None:
            return
        now = self._clock()
        if self._starting_since is None:
            self._starting_since = now
        remaining = max(0.0, self.start_s - (now - self._starting_since))
        self._check(remaining + self.view().wait_s(), self.slo_s)

    @staticmethod
    def _check(predicted_s: float, slo_s: float) -> None:
        if predicted_s > slo_s:
            retry = retry_after(predicted_s, slo_s)
            raise Rejected("predicted_wait", f"the predicted wait for a first token is "
                           f"{predicted_s:.1f}s, over this server's TTFT objective of "
                           f"{slo_s:g}s; retry after {retry}s", retry)
