"""Why an ``AsyncEngine`` cannot serve, and the watchdog that notices a stalled step.

A step that never returns (a deadlock, a collective whose peer is gone, a hung kernel) would
otherwise stall every stream with no error, while the step thread looks alive. The loop thread
marks each step's start and end (one attribute write each); a daemon thread wakes every
``min(1 s, step_timeout_s / 10)`` and, once the step in progress has run past the bound, records
the stall and calls ``on_stall`` once. A stall is final: the step may never return, and one
that does has already outlived its bound, so the engine is to be replaced.

Light on purpose (no torch): the serving layer imports these errors to answer 503.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class EngineDeadError(RuntimeError):
    """The step loop has stopped, or stalled; no request can be served."""


class EngineStalledError(EngineDeadError):
    """A step has run longer than ``step_timeout_s``: the engine serves nothing more."""


class StepWatchdog:
    def __init__(self, timeout_s: float | None,
                 on_stall: Callable[[EngineStalledError], None]) -> None:
        """Watch steps against ``timeout_s`` (None: no watchdog thread, never stalls);
        ``on_stall`` is called once, from the watchdog's thread, with the stall's error."""
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._current: tuple[int, float] | None = None  # (step number, monotonic start)
        self.stalled: str | None = None  # the stall's message, once there is one
        self._stop = threading.Event()
        if timeout_s is not None:
            threading.Thread(target=self._watch, args=(timeout_s,), name="pagedserve-watchdog",
                             daemon=True).start()

    def begin(self, step: int) -> None:
        """The loop thread starts step number ``step``."""
        self._current = (step, time.monotonic())

    def end(self) -> None:
        """The loop thread's step returned (or raised)."""
        self._current = None

    def error(self) -> EngineStalledError | None:
        """A new ``EngineStalledError`` once the engine has stalled, else None (not blocking)."""
        return None if self.stalled is None else EngineStalledError(self.stalled)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, timeout_s: float) -> None:
        while not self._stop.wait(min(1.0, timeout_s / 10)):
            current = self._current  # one read: a step number and its own start
            if current is None or (ran := time.monotonic() - current[1]) <= timeout_s:
                continue
            self.stalled = (f"engine stalled: step {current[0]} has run for {ran:.1f}s, over "
                            f"step_timeout_s={timeout_s:g}s; this engine serves no more "
                            "requests")
            self._on_stall(EngineStalledError(self.stalled))
            return
