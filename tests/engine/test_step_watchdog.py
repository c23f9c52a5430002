"""AsyncEngine's step watchdog (``step_timeout_s``, ``engine/health.py``).

A step that hangs past the bound fails ``check_health`` with a message naming the step, how
long it has run and the bound; the open stream ends with ``EngineStalledError``; a new request
fails at once instead of queueing behind the stuck step. Only the step in progress is timed:
idle time and a request whose steps each stay under the bound never stall the engine.

The hang is ``LLMEngine.step`` replaced on the instance by one that waits on an event (bounded,
so a broken watchdog fails the test instead of hanging it); releasing it lets the loop end.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from engine import AsyncEngine, SamplingParams
from engine.health import EngineDeadError, EngineStalledError
from tests.checkpoints import make_checkpoint

BOUND_S = 0.5
SLACK_S = 2.0  # the watchdog wakes every bound / 10; the rest is a busy 2-core machine
STALL = re.compile(r"engine stalled: step \d+ has run for \d+\.\ds, over step_timeout_s=0\.5s; "
                   "this engine serves no more requests")
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, output_kind="delta",
                        detokenize=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


class Hang:
    """``engine.step`` replaced by one that blocks while ``hold`` is set (at most 30 s), after
    ``delay_s`` seconds of every step."""

    def __init__(self, engine: AsyncEngine, monkeypatch, delay_s: float = 0.0) -> None:
        self.hold, self.entered, self.delay_s = threading.Event(), threading.Event(), delay_s
        self.entered_at = 0.0  # when a step began to wait (monotonic)
        self.step = engine.engine.step
        monkeypatch.setattr(engine.engine, "step", self._step)

    def _step(self):
        time.sleep(self.delay_s)
        if self.hold.is_set():
            self.entered_at = time.monotonic()
            self.entered.set()
            deadline = time.monotonic() + 30
            while self.hold.is_set() and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.step()


@pytest.fixture
def engine(ckpt):
    eng = AsyncEngine(model=ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
                      num_threads=1, step_timeout_s=BOUND_S)
    yield eng
    eng.shutdown()
    assert not eng._thread.is_alive()


def test_a_hung_step_fails_the_health_check_its_stream_and_new_requests(engine, monkeypatch):
    hang = Hang(engine, monkeypatch)

    async def main():
        engine.check_health()
        hang.hold.set()
        stream = engine.generate("stuck", [0, 5, 6], PARAMS)
        first = asyncio.ensure_future(stream.__anext__())
        assert await asyncio.to_thread(hang.entered.wait, 10)
        with pytest.raises(EngineStalledError) as err:
            await asyncio.wait_for(first, BOUND_S + SLACK_S)
        waited = time.monotonic() - hang.entered_at
        assert STALL.fullmatch(str(err.value)), str(err.value)
        assert BOUND_S - 0.05 < waited < BOUND_S + SLACK_S
        with pytest.raises(EngineStalledError, match=STALL):
            engine.check_health()
        start = time.monotonic()
        with pytest.raises(EngineStalledError, match=STALL):
            await engine.generate("new", [0, 7], PARAMS).__anext__()
        assert time.monotonic() - start < 1.0  # refused, not queued behind the stuck step
        assert isinstance(err.value, EngineDeadError) and not engine.is_running

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        hang.hold.clear()  # the step returns; the loop, stopped by the stall, ends
    with pytest.raises(EngineStalledError, match=STALL):
        engine.check_health()  # a stall is final: the engine is to be replaced


def test_only_the_step_in_progress_is_timed(engine, monkeypatch):
    """Steps of 0.3 s (a request of 4 steps takes 1.2 s) and 0.7 s idle stay healthy; a hang
    does not."""
    hang = Hang(engine, monkeypatch, delay_s=0.3)

    async def main():
        outs = [o async for o in engine.generate("slow", [0, 5, 6], PARAMS)]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 4
        await asyncio.sleep(BOUND_S + 0.2)
        engine.check_health()
        hang.hold.set()
        stream = engine.generate("stuck", [0, 8], PARAMS)
        with pytest.raises(EngineStalledError, match=STALL):
            await asyncio.wait_for(stream.__anext__(), 0.3 + BOUND_S + SLACK_S)

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        hang.hold.clear()


def test_the_bound_is_validated_and_none_turns_the_watchdog_off():
    from engine.config import EngineConfig

    assert EngineConfig().scheduler.step_timeout_s == 300.0
    assert EngineConfig.from_kwargs(step_timeout_s=None).scheduler.step_timeout_s is None
    with pytest.raises(ValueError, match="step_timeout_s"):
        EngineConfig.from_kwargs(step_timeout_s=0)
