"""A Worker replica's start, phase by phase: what ``load_tests/start_time.py`` reads (#53).

``Worker.start_phases()`` (a control call: ``target_replica`` names the replica) answers
wall-clock timestamps (``time.time()``, so a driver on the same machine can line them up with
Serve's controller log and its own clock):

* ``process_start``: when the replica's process started (``/proc/self/stat``);
* ``imports_start``: when the process began importing ``serve_app`` (the Worker's module and
  what it imports: torch, the engine), after Ray's and Serve's own start-up;
* ``engine_start`` / ``engine_end``: the engine's build, which is ``Worker.__init__`` but for
  microseconds;

and the engine's own phases in seconds (``LLMEngine.start_clock``: engine_setup, model_init,
weight_load, pack, warm_up, kv_alloc, cuda_graphs).
"""

from __future__ import annotations

import os
import time
from typing import TypedDict

from serve_app import import_time


class StartPhases(TypedDict):
    replica: str
    process_start: float | None  # wall-clock seconds (None where /proc is missing)
    imports_start: float
    engine_start: float | None  # None for an engine without a start clock (a test's fake)
    engine_end: float | None
    engine: dict[str, float]  # the engine's phases, seconds


class StartTimed:
    """The Worker's control call that answers how its start went."""

    replica_id: str

    async def start_phases(self, target_replica: str | None = None) -> StartPhases:
        """When this replica's start phases began and ended (see ``serve_app.worker.startup``)."""
        engine = getattr(self, "engine", None)  # the Worker's (an AsyncEngine: its LLMEngine's)
        clock = getattr(getattr(engine, "engine", engine), "start_clock", None)
        return {"replica": self.replica_id, "process_start": process_start_time(),
                "imports_start": import_time.IMPORTED_AT,
                "engine_start": clock.started_at if clock else None,
                "engine_end": clock.last_mark_at if clock else None,
                "engine": dict(clock.phases) if clock else {}}


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall-clock start of a process (Linux): now, less the system's uptime since the
    process's start in clock ticks (``/proc/uptime`` has 10 ms resolution; ``btime`` 1 s)."""
    try:
        now = time.time()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    except (OSError, IndexError, ValueError):
        return None
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
