"""Demand signals: what the Routers see arrive, forwarded to the autoscaler through the Workers.

Serve's autoscaling policy reads only what Worker replicas report (``record_autoscaling_stats``),
but demand shows first at the Routers, before any engine queue grows. So:

* ``DemandReporter`` (each Router replica) meters the requests it accepts (a prompt with ``n``
  choices counts ``n``) and their prompt tokens as rates over the last ``RATE_WINDOW_S``, and
  every ``REPORT_PERIOD_S`` sends every Worker replica ``report_demand(router_key,
  arrivals_per_s, prompt_tokens_per_s, waiting)``: fire and forget, bounded by
  ``REPORT_TIMEOUT_S``; a failed report is logged at debug and never touches a request.
  ``waiting`` = requests this Router accepted and has not handed to a Worker yet (batcher queue,
  handle back-off).
* ``DemandReceiver`` (a base class of the Worker) keeps each Router's latest report for
  ``REPORT_TTL_S`` and reports the sums over the fresh ones, and this replica's finished
  requests per second (``FINISHED_WINDOW_S``, the engine's window for output tokens/s). Every
  Worker holds the same sums, so the policy takes the largest report, not the sum over replicas.

The clocks are injectable, so the rates and expiries are tested on a scripted clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterable
from typing import Any

from serve_app.router.worker_client import fresh_call
from serve_app.wire import DemandStats

logger = logging.getLogger("ray.serve")

RATE_WINDOW_S = 2.0  # a Router's arrival rates are over its last 2 s
REPORT_PERIOD_S = 1.0  # each Router reports to every Worker this often
REPORT_TIMEOUT_S = 1.0  # a report not delivered by then is dropped (the next one follows)
REPORT_TTL_S = 3.0  # a Worker forgets a Router's report this long after receiving it
FINISHED_WINDOW_S = 10.0  # as the engine's output_tokens_per_s

Clock = Callable[[], float]


class RateWindow:
    """Amounts per second over a trailing window: what was added within ``window_s`` of now
    (inclusive), divided by ``window_s``."""

    def __init__(self, window_s: float, clock: Clock = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, float]] = deque()

    def add(self, amount: float) -> None:
        if amount:
            now = self._clock()
            self._events.append((now, amount))
            self._expire(now)

    def rate(self) -> float:
        now = self._clock()
        self._expire(now)
        return sum(amount for _, amount in self._events) / self.window_s

    def _expire(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()


def unrouted(active: Iterable[Any]) -> int:
    """Sequences of ``active`` (the Router's ``EngineRequest``s) not handed to a Worker yet:
    no Worker replica took them and they are not over."""
    return sum(r.params.n for r in active if r.replica is None and not r.finished)


class DemandReporter:
    """A Router's demand meter and its reports to every Worker replica."""

    def __init__(self, handle: Any, replicas: Callable[[], list[str]], active: Collection[Any],
                 clock: Clock = time.monotonic) -> None:
        """``handle``: the Worker deployment's; ``replicas``: the running Worker replicas'
        ids; ``active``: the Router's live ``EngineRequest``s (its waiting count is their
        ``unrouted``)."""
        self.router_key = uuid.uuid4().hex
        self.arrivals = RateWindow(RATE_WINDOW_S, clock)
        self.prompt_tokens = RateWindow(RATE_WINDOW_S, clock)
        self._handle = handle
        self._replicas = replicas
        self._active = active
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.Task[None] | None = None

    def accepted(self, requests: int, prompt_tokens: int) -> None:
        """The Router admitted ``requests`` sequences carrying ``prompt_tokens`` prompt tokens."""
        self.arrivals.add(requests)
        self.prompt_tokens.add(prompt_tokens)

    def report(self) -> dict[str, Any]:
        """``Worker.report_demand``'s arguments now."""
        return {"router_key": self.router_key, "arrivals_per_s": self.arrivals.rate(),
                "prompt_tokens_per_s": self.prompt_tokens.rate(), "waiting": unrouted(self._active)}

    def start(self) -> DemandReporter:
        """Report every ``REPORT_PERIOD_S`` from now on (on the running event loop)."""
        self._loop = asyncio.get_running_loop().create_task(self._report_forever())
        return self

    async def _report_forever(self) -> None:
        while True:
            await asyncio.sleep(REPORT_PERIOD_S)
            try:
                self.send()
            except Exception as exc:  # never let the loop die: the next tick tries again
                logger.debug("demand report not sent: %r", exc)

    def send(self) -> None:
        """One report to every running Worker replica, each call on its own, bounded."""
        report = self.report()
        for replica in self._replicas():
            task = asyncio.get_running_loop().create_task(
                _deliver(self._call(report, replica), replica))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _call(self, report: dict[str, Any], replica: str) -> Any:
        return fresh_call(lambda: self._handle.report_demand.remote(**report,
                                                                    target_replica=replica))


async def _deliver(call: Any, replica: str) -> None:
    async def wait() -> Any:
        return await call

    try:
        await asyncio.wait_for(wait(), REPORT_TIMEOUT_S)
    except Exception as exc:
        call.cancel()
        logger.debug("demand report to %s failed: %r", replica, exc)


class DemandBoard:
    """A Worker's view of the Routers' demand, and its own finished requests."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._reports: dict[str, tuple[float, float, float, float]] = {}  # key -> (at, a, t, w)
        self.finished = RateWindow(FINISHED_WINDOW_S, clock)

    def report(self, router_key: str, arrivals_per_s: float, prompt_tokens_per_s: float,
               waiting: float) -> None:
        self._reports[router_key] = (self._clock(), float(arrivals_per_s),
                                     float(prompt_tokens_per_s), float(waiting))

    def stats(self) -> DemandStats:
        """The sums over the Routers' fresh reports (0.0 with none), and finished/s."""
        now = self._clock()
        for key in [k for k, (at, *_) in self._reports.items() if now - at > REPORT_TTL_S]:
            del self._reports[key]
        fresh = list(self._reports.values())
        return DemandStats(finished_per_s=self.finished.rate(),
                           demand_arrivals_per_s=sum(r[1] for r in fresh),
                           demand_prompt_tokens_per_s=sum(r[2] for r in fresh),
                           demand_router_waiting=sum(r[3] for r in fresh))


class DemandReceiver:
    """The Worker's side (a base class of ``serve_app.worker.worker.Worker``): its ``DemandBoard``,
    made on first use, and the control call Routers send it."""

    _board: DemandBoard | None = None

    @property
    def demand(self) -> DemandBoard:
        if self._board is None:
            self._board = DemandBoard()
        return self._board

    async def report_demand(self, router_key: str, arrivals_per_s: float,
                            prompt_tokens_per_s: float, waiting: float,
                            target_replica: str | None = None) -> None:
        """A Router's demand now (``DemandReporter``), routed to this replica by name."""
        self.demand.report(router_key, arrivals_per_s, prompt_tokens_per_s, waiting)
