"""One open ``Worker.generate_batch`` stream: the engine's per-step records in, one
``wire.StepMessage`` per record out.

A ``BatchStream`` holds the ``engine.StepStream`` of its requests (the batch that opened it, and
the batches that joined it) and what each request's end needs: its key on the wire, its prompt's
length, its cached prompt tokens and its prompt logprobs (sent once, with its ``DonePart``).
``message`` maps one record to one message; ``error_part`` is the one place a failure becomes an
HTTP status.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from engine import EngineDeadError, PromptLogprobs, RequestOutput, StepOutputs, StepStream
from serve_app import wire
from serve_app.metrics.worker import WorkerMetrics

logger = logging.getLogger("ray.serve")


@dataclass
class _Request:
    key: int | str  # its name on the wire: its position in the batch, or its id
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    last_output_at: float = 0.0  # for the inter-token latency


class BatchStream:
    """The requests one ``generate_batch`` call streams, and their engine ``StepStream``."""

    def __init__(self, steps: StepStream, metrics: WorkerMetrics) -> None:
        self.id = uuid.uuid4().hex
        self.steps = steps
        self.requests: dict[str, _Request] = {}  # request id -> what its parts need
        self._metrics = metrics

    def add(self, requests: list[wire.WorkerRequest], by_id: bool) -> None:
        """Requests to carry (keyed on the wire by id, or by position in their batch)."""
        for slot, req in enumerate(requests):
            key: int | str = req.request_id if by_id else slot
            self.requests.setdefault(req.request_id, _Request(key, len(req.prompt_token_ids)))
        self.steps.add(requests)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort those of the requests still open here; returns them. Their ``DonePart``s
        come in the next message."""
        return self.steps.abort(request_ids)

    def message(self, record: StepOutputs) -> wire.StepMessage:
        """One engine step's record (or the stream's own aborts) as one wire message."""
        message = wire.StepMessage([], [], [])
        now = time.monotonic()
        for out in record.outputs:
            if (req := self.requests.get(out.request_id)) is not None:
                self._output(req, out, now, message)
        for request_id, err in record.failed:
            if (req := self.requests.pop(request_id, None)) is not None:
                message.errors.append(error_part(req.key, err, request_id))
        for request_id in record.aborted:
            if (req := self.requests.pop(request_id, None)) is not None:
                message.done.append(wire.DonePart(req.key, req.num_prompt_tokens,
                                                  req.num_cached_tokens))
        return message

    def _output(self, req: _Request, out: RequestOutput, now: float,
                message: wire.StepMessage) -> None:
        if req.last_output_at:
            self._metrics.output_gap(now - req.last_output_at)
        req.last_output_at = now
        req.num_cached_tokens = out.num_cached_tokens
        req.prompt_logprobs = out.prompt_logprobs or req.prompt_logprobs  # (sent once)
        for co in out.outputs:
            if co.token_ids or co.finish_reason:
                message.tokens.append(wire.TokenPart(req.key, co.index, co.token_ids,
                                                     co.finish_reason, co.logprobs))
        if out.finished:
            self._metrics.request_finished(out)
            del self.requests[out.request_id]
            message.done.append(wire.DonePart(req.key, req.num_prompt_tokens,
                                              req.num_cached_tokens, req.prompt_logprobs))


def error_part(key: int | str, err: BaseException, request_id: str) -> wire.ErrorPart:
    """Why a request failed, as the Router answers it: 400 for bad input, 503 when the engine
    stopped or stalled (Serve replaces this replica), else 500 (an engine error in this request
    only; the others go on)."""
    if isinstance(err, ValueError):
        return wire.ErrorPart(key, 400, str(err))
    if isinstance(err, EngineDeadError):
        return wire.ErrorPart(key, 503, str(err))
    logger.error("request %s failed", request_id, exc_info=err)
    return wire.ErrorPart(key, 500, f"engine error: {type(err).__name__}: {err}")
