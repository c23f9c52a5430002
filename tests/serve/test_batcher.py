"""The Router's dynamic batcher, without a Ray cluster: when batches go, and how big."""

from __future__ import annotations

import asyncio

from engine.core.sampling_params import SamplingParams
from serve_app.router.batch import Batch, EngineRequest
from serve_app.router.batcher import DynamicBatcher


def _req(n_tokens: int = 4) -> EngineRequest:
    return EngineRequest(list(range(n_tokens)), SamplingParams(max_tokens=2))


def test_batcher_flushes_when_idle_on_size_on_time_and_when_routed():
    async def run():
        sent: list[Batch] = []

        async def send(batch: Batch) -> None:  # a Worker that answers when the test says so
            sent.append(batch)
            await asyncio.sleep(3600)

        def sizes() -> list[int]:
            return [len(b.requests) for b in sent]

        def route(i: int) -> None:
            sent[i].mark_routed("replica-a")

        b = DynamicBatcher(send, max_batch_size=3, batch_wait_s=0.05)
        b.submit(_req())
        await asyncio.sleep(0)
        assert sizes() == [1]  # nothing on its way: sent at once, alone
        for _ in range(4):
            b.submit(_req())
        await asyncio.sleep(0)
        assert sizes() == [1, 3]  # waited for the first; a full batch goes at once
        await asyncio.sleep(0.1)
        assert sizes() == [1, 3, 1]  # the last one waited batch_wait_s
        b.submit(_req())
        b.submit(_req())
        await asyncio.sleep(0.01)
        assert sizes() == [1, 3, 1]  # three batches on their way
        route(0)
        route(1)
        await asyncio.sleep(0)
        assert sizes() == [1, 3, 1]
        route(2)  # the last one routed: what waited goes now, before its timer
        await asyncio.sleep(0.001)
        assert sizes() == [1, 3, 1, 2]
        per_request = DynamicBatcher(send, max_batch_size=1, batch_wait_s=0.0)
        per_request.submit(_req())
        per_request.submit(_req())
        await asyncio.sleep(0)
        assert sizes() == [1, 3, 1, 2, 1, 1]
        route(3)
        await asyncio.sleep(0.001)  # nothing on its way now
        b.submit(*[_req() for _ in range(5)])  # one HTTP request's prompts: not one alone first
        await asyncio.sleep(0)
        assert sizes() == [1, 3, 1, 2, 1, 1, 3, 2]
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    asyncio.run(run())
