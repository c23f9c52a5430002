"""``AsyncEngine``: the step loop in a background thread; per step, one record per consumer.

The loop thread alone touches the ``LLMEngine``, and builds it: on a CPU, a second thread that
ran torch's parallel work (loading, packing, warm-up) would keep an OpenMP thread team of its
own, and with more OpenMP threads than cores libgomp stops spinning at barriers, so every
parallel region of a step pays a sleep and a wake-up (a 0.5B model decoded 25-40% slower on two
cores that way). Callers talk to the loop through an inbox (add, abort) and receive, per step,
one ``StepOutputs`` per consumer on its ``StepStream`` (``add_batch``; ``engine/step_stream.py``).
``generate`` is the per-request view of the same. Closing a stream aborts its open requests; a
request that fails (bad input, an error while processing its tokens) fails in its record only,
and the loop goes on serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal

from engine.config import EngineConfig
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.stats import AsyncEngineStats, StepFigures
from engine.health import EngineDeadError, EngineStalledError, StepWatchdog
from engine.llm_engine import LLMEngine, PromptType
from engine.step_stream import Outbox, StepRequest, StepStream, Subscribers

logger = logging.getLogger(__name__)


# The loop thread's inbox: ("add", request_id, prompt, params, arrival) or ("abort", request_id).
_Message = (tuple[Literal["add"], str, PromptType, SamplingParams, float]
            | tuple[Literal["abort"], str])


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
        self._subscribers = Subscribers()  # request id -> the stream it reports to
        self._stopping = False
        self._figures = StepFigures()
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
    def add_batch(self, requests: Iterable[StepRequest]) -> StepStream:
        """Queue ``(request_id, prompt, params)`` requests and open their ``StepStream``: one
        ``StepOutputs`` per step that touched them. Call it on the event loop that reads it."""
        stream = StepStream(self, asyncio.get_running_loop())
        stream.add(requests)
        return stream

    async def generate(self, request_id: str, prompt: PromptType,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream ``RequestOutput``s for one request (a one-request ``add_batch``). Bad input
        raises ``ValueError`` before the first output; leaving the loop early aborts the request
        and frees its blocks. A stopped or stalled engine raises ``EngineDeadError``
        (``EngineStalledError``) at once."""
        stream = self.add_batch([(request_id, prompt, params)])
        try:
            async for record in stream:
                for _, err in record.failed:
                    raise err
                for out in record.outputs:
                    yield out
        finally:
            stream.close()

    def subscribe(self, stream: StepStream, request: StepRequest) -> BaseException | None:
        """``StepStream.add``'s half: route the request's records to ``stream`` and queue it, or
        return why not (a reused id; a stopped or stalled engine)."""
        rid, prompt, params = request
        refused = self._subscribers.add(stream, rid)
        if refused is not None:
            return refused
        if not self.is_running:  # checked once routed: a later stall reaches the stream
            self._subscribers.remove(stream, [rid])
            return self._watchdog.error() or EngineDeadError("the engine has stopped")
        self._send(("add", rid, prompt, params, time.monotonic()))
        return None

    def unsubscribe(self, stream: StepStream, request_ids: Iterable[str], abort: bool) -> None:
        """``StepStream``'s half: its requests ended (or it aborts them, with ``abort``)."""
        for rid in self._subscribers.remove(stream, request_ids):
            if abort:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is (thread-safe, idempotent). Its open stream, if any,
        ends with an output whose unfinished sequences have finish reason "abort"."""
        self._send(("abort", request_id))

    def get_stats(self) -> AsyncEngineStats:
        return AsyncEngineStats(**self._stats,
                                output_tokens_per_s=self._figures.output_tokens_per_s())

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
        return self._figures.pop_steps()

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
                outbox = self._subscribers.outbox()  # this iteration's records
                self._drain_inbox(outbox)
                if self.engine.has_unfinished():
                    self._step(outbox)
                outbox.flush()
                if not self.engine.has_unfinished():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
        finally:
            self._stopping = True  # no stream subscribes from now on
            self._subscribers.fail_all(EngineDeadError("the engine has stopped"))
            self.engine.shutdown()

    def _drain_inbox(self, outbox: Outbox) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, arrival = msg
                if rid not in self._subscribers:
                    continue  # its consumer left before it was added
                try:
                    self.engine.add_request(rid, prompt, params, arrival)
                except Exception as e:  # bad input: fail this request only
                    outbox.fail([rid], e)
            else:
                final = self.engine.abort(msg[1])
                if final is not None:
                    outbox.output(final)
            self._stats = self.engine.get_stats()

    def _step(self, outbox: Outbox) -> None:
        before = self.engine.generation_tokens_total
        start, batched = time.monotonic(), self.engine.num_batched_tokens_total
        self._watchdog.begin(self.engine.num_steps + 1)
        try:
            outputs = self.engine.step()
        except Exception as e:  # a failure inside the model: fail what was in flight
            failed = list(self.engine.groups)
            for rid in failed:
                self.engine.abort(rid)
            outbox.fail(failed, RuntimeError(f"engine step failed: {e!r}"))
            if self.engine.failed is not None:  # a tensor-parallel rank is gone: stop serving
                self._stopping = True
            return
        finally:
            self._watchdog.end()
        for rid, err in self.engine.pop_errors():
            outbox.fail([rid], err)
        self._figures.record(start, time.monotonic(), self.engine.generation_tokens_total - before,
                             self.engine.num_batched_tokens_total - batched)
        self._stats = self.engine.get_stats()
        for out in outputs:
            outbox.output(out)

    def _on_stall(self, err: EngineStalledError) -> None:
        """The watchdog's thread: a step outlived its bound. Fail every open stream, refuse new
        requests, and stop the loop should the step ever return."""
        frame = sys._current_frames().get(self._thread.ident or 0)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        logger.error("%s. The step loop's stack:\n%s", err, stack)
        self._stopping = True
        self._subscribers.fail_all(err)
