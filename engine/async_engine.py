"""``AsyncEngine``: the step loop in a background thread, one async stream per request.

The loop thread alone touches the ``LLMEngine``, and builds it: on a CPU, a second thread that
ran torch's parallel work (loading, packing, warm-up) would keep an OpenMP thread team of its
own, and with more OpenMP threads than cores libgomp stops spinning at barriers, so every
parallel region of a step pays a sleep and a wake-up (a 0.5B model decoded 25-40% slower on two
cores that way). Callers talk to the loop through an inbox (add, abort) and receive outputs on
per-request ``asyncio`` queues. Closing or cancelling a stream aborts its request; a request
that fails (bad input, an error while processing its tokens) raises in its own stream only,
and the loop goes on serving the others.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.stats import AsyncEngineStats
from engine.health import EngineDeadError, EngineStalledError, StepWatchdog
from engine.llm_engine import LLMEngine, PromptType

logger = logging.getLogger(__name__)

_RATE_WINDOW_S = 10.0
_MAX_STEP_RECORDS = 4096  # per-step records kept until pop_step_records() drains them


# What a stream receives: outputs, or the exception that ends it.
_Item = RequestOutput | BaseException
# The loop thread's inbox: ("add", request_id, prompt, params, arrival) or ("abort", request_id).
_Message = (tuple[Literal["add"], str, PromptType, SamplingParams, float]
            | tuple[Literal["abort"], str])


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Item]


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = False,
                 **kwargs: Any):
        """Builds the ``LLMEngine`` (``config``, or ``kwargs`` as ``EngineConfig.from_kwargs``)
        in the loop thread and returns once it is built; a build error is raised here."""
        built: queue.SimpleQueue[LLMEngine | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._build_and_run,
                                        args=(config, progress, kwargs, built),
                                        name="pagedserve-engine", daemon=True)
        self._inbox: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._steps: collections.deque[tuple[float, int]] = collections.deque(
            maxlen=_MAX_STEP_RECORDS)
        self._thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            self._thread.join()
            raise result
        self.engine = result
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.dtype = self.engine.dtype  # the activations' dtype in use (dtype="auto" resolved)
        self.quantization = self.engine.quantization  # the weights' format; None: dtype
        self.kv_cache_dtype = self.engine.kv_cache_dtype  # "fp8_e4m3", or the dtype's name
        self.default_sampling = self.engine.default_sampling  # generation_config.json's

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> AsyncEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ----------------------------------------------------------------- the public face
    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream ``RequestOutput``s for one request. Bad input raises ``ValueError`` before the
        first output; leaving the loop early aborts the request and frees its blocks. A stopped
        or stalled engine raises ``EngineDeadError`` (``EngineStalledError``) at once."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        finished = False
        try:
            if not self.is_running:  # checked once registered: a later stall reaches the stream
                raise self._watchdog.error() or EngineDeadError("the engine has stopped")
            self._send(("add", request_id, prompt, params, time.monotonic()))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is (thread-safe, idempotent). Its open stream, if any,
        ends with an output whose unfinished sequences have finish reason "abort"."""
        self._send(("abort", request_id))

    def get_stats(self) -> AsyncEngineStats:
        now = time.monotonic()
        window = [n for t, n in list(self._rate) if now - t <= _RATE_WINDOW_S]
        return AsyncEngineStats(**self._stats, output_tokens_per_s=sum(window) / _RATE_WINDOW_S)

    def check_health(self) -> None:
        """Raise when no request can be served: a step has run past ``step_timeout_s``
        (``EngineStalledError``), the loop has stopped, or a tensor-parallel rank has
        (``TensorParallelError``). Never blocks."""
        stalled = self._watchdog.error()
        if stalled is not None:
            raise stalled
        if not self.is_running:
            raise EngineDeadError("the engine's step loop has stopped")
        self.engine.check_health()

    def pop_step_records(self) -> list[tuple[float, int]]:
        """``(duration_s, num_batched_tokens)`` of each step that ran since the last call, oldest
        first (thread-safe; at most the last 4096 are kept)."""
        steps = self._steps
        return [steps.popleft() for _ in range(len(steps))]

    def shutdown(self) -> None:
        """Stop the loop (which then stops any tensor-parallel ranks)."""
        self._stopping = True
        self._wakeup.set()
        self._watchdog.stop()
        self._thread.join(timeout=1 if self._watchdog.stalled else 30)
        if self._thread.is_alive():  # stuck in a step: kill the ranks rather than message them
            self.engine.shutdown(send_exit=False)

    # ----------------------------------------------------------------- the loop thread
    def _send(self, msg: _Message) -> None:
        self._inbox.put(msg)
        self._wakeup.set()

    def _build_and_run(self, config: EngineConfig | None, progress: bool, kwargs: dict[str, Any],
                       built: queue.SimpleQueue[LLMEngine | BaseException]) -> None:
        try:
            self.engine = LLMEngine(config, progress=progress, **kwargs)
            self._stats = self.engine.get_stats()
        except BaseException as e:  # handed to the constructor, which raises it
            built.put(e)
            return
        self._watchdog = StepWatchdog(self.engine.config.scheduler.step_timeout_s,
                                      self._on_stall)
        built.put(self.engine)
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                self._step()
        finally:
            self._fail_all(EngineDeadError("the engine has stopped"))
            self.engine.shutdown()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, arrival = msg
                if rid not in self._streams:
                    continue  # its consumer left before it was added
                try:
                    self.engine.add_request(rid, prompt, params, arrival)
                except Exception as e:  # bad input: fail this request only
                    self._deliver(rid, e)
            else:
                final = self.engine.abort(msg[1])
                self._stats = self.engine.get_stats()
                if final is not None:
                    self._deliver(msg[1], final)
                continue
            self._stats = self.engine.get_stats()

    def _step(self) -> None:
        before = self.engine.generation_tokens_total
        start, batched = time.monotonic(), self.engine.num_batched_tokens_total
        self._watchdog.begin(self.engine.num_steps + 1)
        try:
            outputs = self.engine.step()
        except Exception as e:  # a failure inside the model: fail what was in flight
            for rid in list(self.engine.groups):
                self.engine.abort(rid)
                self._deliver(rid, RuntimeError(f"engine step failed: {e!r}"))
            if self.engine.failed is not None:  # a tensor-parallel rank is gone: stop serving
                self._stopping = True
            return
        finally:
            self._watchdog.end()
        for rid, err in self.engine.pop_errors():
            self._deliver(rid, err)
        now = time.monotonic()
        self._rate.append((now, self.engine.generation_tokens_total - before))
        if self.engine.num_batched_tokens_total != batched:
            self._steps.append((now - start, self.engine.num_batched_tokens_total - batched))
        while self._rate and now - self._rate[0][0] > _RATE_WINDOW_S:
            self._rate.popleft()
        self._stats = self.engine.get_stats()
        self._deliver_step(outputs)

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs: one thread-safe callback per event loop, not one per request (each
        costs a wake-up of the loop), putting them on their streams in order."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item: _Item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self, err: BaseException) -> None:
        for rid in list(self._streams):
            self._deliver(rid, err)

    def _on_stall(self, err: EngineStalledError) -> None:
        """The watchdog's thread: a step outlived its bound. Fail every open stream, refuse new
        requests, and stop the loop should the step ever return."""
        frame = sys._current_frames().get(self._thread.ident or 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        logger.error("%s. The step loop's stack:\n%s", err, stack)
        self._stopping = True
        self._fail_all(err)


def _put_all(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for q, item in items:
        q.put_nowait(item)
