"""Work with a time bound on threads that cannot be stopped: grammar compiles.

A compile runs in xgrammar's C++ code (without the interpreter lock), and a Python thread cannot
be interrupted, so a compile past its bound cannot be cut short: its job fails instead, and its
thread runs on in the background, its result dropped when it ends. The pool keeps the damage
bounded:

- at most ``threads`` jobs run at once; the others wait in order of submission;
- a job must start within ``timeout_s`` of its submission and end within ``timeout_s`` of its
  start, else its future fails with ``CompileTimeout`` (naming the job and the bound);
- a job that overruns gives its place to the next one while fewer than ``threads`` overrun
  jobs are still running; beyond that it keeps its place. So one pathological job delays
  the others by at most ``timeout_s``, and at most ``2 * threads`` threads ever compile;
- an overrun job's thread drops to the lowest CPU priority (nice 19, Linux), so that it
  takes only what the step loop and the other compiles leave.

Deadlines are checked when ``expire`` is called (the engine calls it every step) and on each
``submit``. At exit the process waits up to ``EXIT_WAIT_S`` for compiles still running: one
that ends while the interpreter finalizes aborts the process (its thread, leaving xgrammar,
takes the interpreter lock during finalization, and Python 3.11 ends such a thread with a
forced unwind that C++ turns into ``std::terminate``).
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

EXIT_WAIT_S = 10.0
_compiling: set[threading.Thread] = set()  # every pool's running threads, overrun ones too


@atexit.register
def _wait_for_compiles() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in list(_compiling):
        thread.join(max(0.0, deadline - time.monotonic()))


class CompileTimeout(ValueError):
    """A job that did not end within its bound; ``started``: it ran (rather than waited for a
    thread) and its thread may still be running."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message)
        self.started = started


@dataclass(eq=False)
class _Job:
    fn: Callable[[], Any]
    what: str  # named in the timeout's message, e.g. "structured_outputs.grammar"
    future: Future[Any]
    deadline: float  # while queued: by when it must start; once running: by when it must end
    overrun: bool = False  # failed at its deadline, its thread still running
    thread_id: int | None = None  # its thread's native id, once running


class DeadlinePool:
    """Runs jobs on at most ``threads`` threads, each within ``timeout_s`` (``setting``: the
    setting's name, for the messages)."""

    def __init__(self, threads: int, timeout_s: float, setting: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threads, self.timeout_s, self.setting = threads, timeout_s, setting
        self._clock = clock
        self._queue: deque[_Job] = deque()
        self._running: set[_Job] = set()  # holding a place (overrun ones too, past the cap)
        self.num_overrun = 0  # overrun jobs that gave their place up, still running
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any], what: str) -> Future[Any]:
        job = _Job(fn, what, Future(), self._clock() + self.timeout_s)
        with self._lock:
            self._queue.append(job)
        self.expire()
        return job.future

    def expire(self) -> None:
        """Fail the jobs past their deadlines, free the places of overrun ones while fewer
        than ``threads`` overrun, and start what waits."""
        if not self._queue and not self._running:
            return
        with self._lock:
            now = self._clock()
            for job in [j for j in self._running if j.deadline <= now]:
                if not job.overrun:
                    self._fail(job, f"{job.what} took longer than {self.timeout_s:g} s to "
                               f"compile ({self.setting}); simplify it", started=True)
                    job.overrun = True
                    _lowest_priority(job.thread_id)
                if self.num_overrun < self.threads:  # give its place to the next job
                    self._running.discard(job)
                    self.num_overrun += 1
            self._start(now)
            while self._queue and self._queue[0].deadline <= now:
                self._fail_waiting(self._queue.popleft())

    def _start(self, now: float) -> None:
        while self._queue and len(self._running) < self.threads:
            job = self._queue.popleft()  # it has a thread: it starts, however long it waited
            job.deadline = now + self.timeout_s
            self._running.add(job)
            thread = threading.Thread(target=self._run, args=(job,), name="grammar-compile",
                                      daemon=True)
            _compiling.add(thread)
            thread.start()

    def _run(self, job: _Job) -> None:
        result: Any = None
        error: BaseException | None = None
        job.thread_id = threading.get_native_id()
        if job.overrun:  # overran before it began
            _lowest_priority(job.thread_id)
        try:
            result = job.fn()
        except BaseException as e:  # the job's own failure, reported on its future
            error = e
        with self._lock:
            if job in self._running:
                self._running.discard(job)
            else:
                self.num_overrun -= 1
            if not job.future.done():  # else it overran: its result is dropped
                if error is None:
                    job.future.set_result(result)
                else:
                    job.future.set_exception(error)
            if not job.overrun:  # a thread made here would inherit an overrun one's nice 19:
                self._start(self._clock())  # expire() starts the next one then
            _compiling.discard(threading.current_thread())

    def _fail_waiting(self, job: _Job) -> None:
        self._fail(job, f"{job.what} waited {self.timeout_s:g} s for one of the {self.threads} "
                   f"compile threads ({self.setting}): other grammars are taking long to "
                   "compile; retry later", started=False)

    @staticmethod
    def _fail(job: _Job, message: str, started: bool) -> None:
        if not job.future.done():
            job.future.set_exception(CompileTimeout(message, started))


def _lowest_priority(thread_id: int | None) -> None:
    """Nice 19 for one thread (Linux threads have their own; elsewhere nothing)."""
    if thread_id is not None and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, 19)
        except OSError:
            pass
