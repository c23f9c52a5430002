"""The Routers' demand signals (``serve_app.router.demand``) on a scripted clock: the Router's rates
over its last 2 s and its waiting count, its reports to every Worker replica, the Worker's
board of reports (3 s expiry, sums over Routers) and finished requests/s, and what a real
Worker adds to ``record_autoscaling_stats`` and ``record_routing_stats``."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.core.sampling_params import SamplingParams
from serve_app.autoscaling.signals import (
    DEMAND_ARRIVALS,
    DEMAND_PROMPT_TPS,
    DEMAND_WAITING,
    FINISHED_PER_S,
)
from serve_app.router.batch import EngineRequest
from serve_app.router.demand import DemandBoard, DemandReporter, unrouted
from serve_app.wire import WorkerRequest
from tests.serve.test_worker import _params, _run, config  # noqa: F401  (fixture)
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _requests() -> set[EngineRequest]:
    """One of each state: unrouted (n=3), at a Worker, finished before any Worker took it."""
    queued = EngineRequest([1, 2], SamplingParams(n=3))
    routed = EngineRequest([1], SamplingParams(n=2))
    routed.replica = "w1"
    failed = EngineRequest([1], SamplingParams())
    failed.fail(503, "gone")
    return {queued, routed, failed}


def test_the_router_meters_arrivals_over_its_last_two_seconds():
    clock = Clock(100.0)
    reporter = DemandReporter(None, list, _requests(), clock=clock)
    reporter.accepted(3, 120)  # a prompt with n=3 counts 3
    clock.t = 101.0
    reporter.accepted(1, 40)
    clock.t = 101.5

    def rates() -> tuple[float, float, int]:
        r = reporter.report()
        assert r["router_key"] == reporter.router_key
        return r["arrivals_per_s"], r["prompt_tokens_per_s"], r["waiting"]

    assert rates() == (2.0, 80.0, 3)  # (3 + 1) / 2 s; waiting: the unrouted one's 3 sequences
    clock.t = 102.0
    assert rates() == (2.0, 80.0, 3)  # the first is exactly 2 s old: still in the window
    clock.t = 102.5
    assert rates() == (0.5, 20.0, 3)
    clock.t = 103.5
    assert rates() == (0.0, 0.0, 3)


def test_unrouted_counts_sequences_no_worker_took():
    assert unrouted(_requests()) == 3


class _Handle:
    """Records ``report_demand.remote`` calls; replica "bad" fails."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.report_demand = self

    def remote(self, **kwargs):
        self.calls.append(kwargs)

        async def answer() -> None:
            if kwargs["target_replica"] == "bad":
                raise RuntimeError("replica gone")

        return _Call(answer())


class _Call:
    def __init__(self, coro) -> None:
        self.coro = coro

    def __await__(self):
        return self.coro.__await__()

    def cancel(self) -> None:
        pass


def test_the_router_reports_to_every_worker_replica_and_a_failure_harms_nothing(caplog):
    handle, clock = _Handle(), Clock()
    reporter = DemandReporter(handle, lambda: ["w1", "bad", "w2"], set(), clock=clock)
    reporter.accepted(4, 100)

    async def main() -> None:
        reporter.send()
        await asyncio.gather(*reporter._tasks)

    with caplog.at_level(logging.DEBUG, logger="ray.serve"):
        asyncio.run(main())
    key = reporter.router_key
    assert handle.calls == [
        {"router_key": key, "arrivals_per_s": 2.0, "prompt_tokens_per_s": 50.0, "waiting": 0,
         "target_replica": r} for r in ("w1", "bad", "w2")]
    failed = [r for r in caplog.records if "demand report to bad failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.DEBUG]


def test_the_worker_sums_fresh_reports_and_forgets_old_ones():
    clock = Clock(0.0)
    board = DemandBoard(clock)
    assert board.stats() == {FINISHED_PER_S: 0.0, DEMAND_ARRIVALS: 0.0, DEMAND_PROMPT_TPS: 0.0,
                             DEMAND_WAITING: 0.0}
    board.report("router-a", 4.0, 300.0, 2)
    clock.t = 2.0
    board.report("router-b", 1.0, 50.0, 5)
    board.report("router-a", 6.0, 400.0, 1)  # the latest report of a Router replaces its last
    clock.t = 5.0
    assert board.stats()[DEMAND_ARRIVALS] == 7.0  # both exactly 3 s old: still fresh
    board.report("router-b", 2.0, 60.0, 0)
    clock.t = 5.5
    assert board.stats() == {FINISHED_PER_S: 0.0, DEMAND_ARRIVALS: 2.0, DEMAND_PROMPT_TPS: 60.0,
                             DEMAND_WAITING: 0.0}  # router-a's report is 3.5 s old: gone
    clock.t = 9.0
    assert board.stats()[DEMAND_ARRIVALS] == 0.0


def test_the_worker_counts_finished_requests_over_ten_seconds():
    clock = Clock(0.0)
    board = DemandBoard(clock)
    board.finished.add(2)
    clock.t = 5.0
    board.finished.add(0)  # a step that finished nothing
    board.finished.add(3)
    clock.t = 10.0
    assert board.stats()[FINISHED_PER_S] == 0.5
    clock.t = 10.5
    assert board.stats()[FINISHED_PER_S] == 0.3
    clock.t = 15.5
    assert board.stats()[FINISHED_PER_S] == 0.0


@pytest.mark.usefixtures("recorded")
def test_a_worker_reports_the_routers_demand_and_its_finished_requests(config):  # noqa: F811
    def signals(stats) -> dict:
        return {k: stats[k] for k in (FINISHED_PER_S, DEMAND_ARRIVALS, DEMAND_PROMPT_TPS,
                                      DEMAND_WAITING)}

    async def test(worker) -> None:
        clock = Clock(100.0)
        worker._board = DemandBoard(clock)
        assert signals(worker.record_autoscaling_stats()) == {
            FINISHED_PER_S: 0.0, DEMAND_ARRIVALS: 0.0, DEMAND_PROMPT_TPS: 0.0,
            DEMAND_WAITING: 0.0}  # no Router has reported
        batch = [WorkerRequest("a", [0, 5], _params(3)), WorkerRequest("b", [0, 7], _params(2))]
        assert len([m async for m in worker.generate_batch(batch, stream_key="r1")]) > 1
        await worker.report_demand("router-a", 4.0, 300.0, 2, target_replica="w1")
        await worker.report_demand("router-b", 1.0, 50.0, 0)
        assert signals(worker.record_autoscaling_stats()) == {
            FINISHED_PER_S: 0.2, DEMAND_ARRIVALS: 5.0, DEMAND_PROMPT_TPS: 350.0,
            DEMAND_WAITING: 2.0}  # 2 requests finished / 10 s; the sums over both Routers
        assert worker.record_routing_stats()["finished_per_s"] == 0.2
        clock.t = 103.5
        assert signals(worker.record_autoscaling_stats()) == {
            FINISHED_PER_S: 0.2, DEMAND_ARRIVALS: 0.0, DEMAND_PROMPT_TPS: 0.0,
            DEMAND_WAITING: 0.0}

    _run(config, test)
