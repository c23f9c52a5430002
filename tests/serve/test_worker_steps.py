"""One engine step, one wire message: the Worker's stream of a batch on a real ``AsyncEngine``
(``test_worker.py``'s Worker and checkpoint), with another task keeping the event loop busy."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.wire import WorkerRequest
from serve_app.worker.worker import Worker
from tests.serve.test_worker import _params, _run, config  # noqa: F401  (the fixture)
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)

pytestmark = pytest.mark.usefixtures("recorded")


def test_each_engine_step_reaches_its_batch_as_one_message(config, monkeypatch):  # noqa: F811
    """The engine hands the Worker one record per step for its stream, so one step's tokens
    for every request of a batch travel in one ``StepMessage``, even while another task keeps
    the event loop busy between the loop thread's hand-overs (a hand-over per request, or
    per-request pumps whose parts are re-collected as "what is queued now", split a step over
    several messages then)."""
    async def test(worker: Worker) -> None:
        engine = worker.engine.engine
        step, stepped = engine.step, []

        def counted_step():
            outputs = step()
            if outputs:
                stepped.append(sorted(o.request_id for o in outputs))
            return outputs

        monkeypatch.setattr(engine, "step", counted_step)
        busy = True

        async def neighbour() -> None:  # another task, ready at every turn of the loop
            while busy:
                await asyncio.sleep(0)

        task = asyncio.create_task(neighbour())
        batch = [WorkerRequest(f"r{i}", [0, 5 + i, 9], _params(6)) for i in range(4)]
        messages = [m async for m in worker.generate_batch(batch)][1:]
        busy = False
        await task
        assert stepped == [["r0", "r1", "r2", "r3"]] * 6  # every step advanced all four
        assert [sorted({t.key for t in m.tokens}) for m in messages] == [[0, 1, 2, 3]] * 6
        assert [len(m.done) for m in messages] == [0] * 5 + [4]

    _run(config, test)
