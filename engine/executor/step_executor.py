"""Runs a scheduled step on the model, so that one request's bad input never fails another.

When the forward or sampling raises (anything but a broken tensor-parallel group), each
request's part of the step is run again alone and only the requests whose part fails again are
failed; the others keep their results. Running a part again rewrites the same KV-cache slots
with the same values. A failure that leaves the tensor-parallel ranks out of step is fatal
(``TensorParallelError``): no further step can run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.sample.sampler import SamplerOutput

if TYPE_CHECKING:
    from engine.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

StepResult = tuple[SchedulerOutput, list[Request], SamplerOutput | None]


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or a step broke off half-way: the engine cannot step."""


class _StepFailed(Exception):
    """The model step failed for a reason that leaves the engine able to step again."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


class StepExecutor:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.failed: BaseException | None = None  # why a tensor-parallel step broke off

    def run(self, sched: SchedulerOutput, fail: Callable[[str, Exception], None]) -> StepResult:
        """Run ``sched``; returns the part that ran (``sched`` less failed requests' parts),
        the requests sampled and their samples. ``fail(group_id, error)`` is called for each
        request whose part failed alone."""
        if self.failed is not None:
            raise TensorParallelError(f"a tensor-parallel step failed: {self.failed!r}")
        try:
            reqs, sampled = self._execute(sched)
        except _StepFailed as failed:
            return self._isolate(sched, failed.error, fail)
        return sched, reqs, sampled

    def _execute(self, sched: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        try:
            return self.runner.execute(sched)
        except BaseException as e:
            if self.runner.tp_broken:  # the ranks are out of step: no further step can run
                self.failed = e
                if isinstance(e, Exception):  # Ctrl-C stays a KeyboardInterrupt
                    raise TensorParallelError(f"a tensor-parallel step failed: {e!r}") from e
                raise
            if isinstance(e, Exception):
                raise _StepFailed(e) from e
            raise

    def _isolate(self, sched: SchedulerOutput, error: Exception,
                 fail: Callable[[str, Exception], None]) -> StepResult:
        parts: dict[str, list[tuple[Request, int]]] = {}
        for req, n in sched.scheduled:
            parts.setdefault(req.group_id, []).append((req, n))
        kept = SchedulerOutput(preempted=sched.preempted)
        reqs: list[Request] = []
        sampled = SamplerOutput([], [])
        for group_id, part in parts.items():
            try:
                if len(parts) == 1:
                    raise _StepFailed(error)
                part_reqs, part_out = self._execute(SchedulerOutput(part))
            except _StepFailed as failed:
                logger.warning("request %s failed in an engine step: %r", group_id, failed.error)
                fail(group_id, failed.error)
                continue
            kept.scheduled.extend(part)
            if part_out is not None:
                reqs.extend(part_reqs)
                sampled.token_ids.extend(part_out.token_ids)
                sampled.logprobs.extend(part_out.logprobs)
        return kept, reqs, sampled
