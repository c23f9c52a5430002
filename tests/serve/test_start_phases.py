"""A replica's start, phase by phase (#53): the engine's ``StartClock`` and
``Worker.start_phases()``, which ``load_tests/start_time.py`` lines up with Serve's log."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core import stats
from engine.core.stats import StartClock
from serve_app.config import AppConfig
from serve_app.worker.worker import Worker
from tests.checkpoints import make_checkpoint
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)

PHASES = ["engine_setup", "model_init", "weight_load", "pack", "warm_up", "kv_alloc",
          "cuda_graphs"]


class FakeTime:
    """``time.time``/``time.perf_counter`` that move only when told."""

    def __init__(self) -> None:
        self.wall, self.perf = 1000.0, 5.0

    def time(self) -> float:
        return self.wall

    def perf_counter(self) -> float:
        return self.perf

    def advance(self, s: float) -> None:
        self.wall += s
        self.perf += s


def test_start_clock_phases_in_order_of_first_mark(monkeypatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(stats, "time", fake)
    clock = StartClock()
    assert clock.started_at == 1000.0 and clock.last_mark_at == 1000.0 and clock.phases == {}
    fake.advance(1.5)
    clock.mark("setup")
    fake.advance(0.25)
    clock.mark("load")
    assert clock.phases == {"setup": 1.5, "load": 0.25} and clock.last_mark_at == 1001.75
    fake.advance(2.0)
    clock.mark("setup")  # a phase marked again adds to its own, keeps its place
    assert list(clock.phases) == ["setup", "load"]
    assert clock.phases == {"setup": 3.5, "load": 0.25} and clock.last_mark_at == 1003.75
    fake.advance(9.0)  # unmarked time is no phase's, and not in last_mark_at
    assert clock.last_mark_at == 1003.75


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> AppConfig:
    path = make_checkpoint(tmp_path_factory.mktemp("llama"))
    return AppConfig(model=str(path), dtype="float32", max_model_len=128, block_size=8,
                     kv_cache_memory_bytes=4 << 20, num_threads=1, accelerator="cpu")


@pytest.mark.usefixtures("recorded")
def test_worker_start_phases(config: AppConfig) -> None:
    before = time.time()

    async def main() -> dict:
        worker = Worker(config, engine_factory=lambda cfg: AsyncEngine(cfg.engine),
                        replica_id="w1")
        try:
            return await worker.start_phases(target_replica="w1")
        finally:
            worker.engine.shutdown()

    p = asyncio.run(main())
    after = time.time()
    assert p["replica"] == "w1"
    assert list(p["engine"]) == PHASES  # every phase, in the order the engine runs them
    assert all(v >= 0 for v in p["engine"].values())
    assert p["engine"]["cuda_graphs"] < 0.01  # a CPU engine captures nothing
    # monotone: the process, then serve_app's import, then the engine's build
    assert p["process_start"] <= p["imports_start"] <= before <= p["engine_start"]
    assert p["engine_start"] <= p["engine_end"] <= after
    # the phases tile the build (each rounded to 0.1 ms)
    assert abs(sum(p["engine"].values()) - (p["engine_end"] - p["engine_start"])) < 1e-3


@pytest.mark.usefixtures("recorded")
def test_engine_without_a_clock_answers_none(config: AppConfig) -> None:
    """A test's fake engine has no start clock: the phases are empty, not an error."""
    class Fake:
        def __init__(self, cfg: AppConfig) -> None:
            self.cfg = cfg

        def shutdown(self) -> None:
            pass

    worker = Worker.__new__(Worker)
    worker.replica_id, worker.engine = "w2", Fake(config)
    p = asyncio.run(worker.start_phases())
    assert (p["engine_start"], p["engine_end"], p["engine"]) == (None, None, {})
