"""``LLMEngine``: the synchronous core. ``add_request`` queues, ``step`` runs one batch and
returns what changed, ``abort`` drops a request and frees its blocks.

With ``tensor_parallel_size`` N > 1 this process is rank 0: it schedules and samples, and starts
ranks 1..N-1 (``engine.tp_ranks``) that hold the other shards of the model; ``shutdown`` stops
them. With N = 1 there is no process group and no other process.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.detokenizer import TextStream
from engine.distributed import check_tp_sizes, tp_size
from engine.kv_cache_manager import KVCacheManager
from engine.layers.sampler import SamplerOutput
from engine.loader import resolve_dtype
from engine.model_runner import ModelRunner
from engine.models.hf_config import HFConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus, group_metrics
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.stats import EngineStats
from engine.tokenizer import check_vocab, eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from engine.tp_ranks import RankGroup, RankLauncher

PromptType = str | Sequence[int] | dict
logger = logging.getLogger(__name__)


@dataclass
class _Group:
    """The ``n`` sequences of one request and what has been reported of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    streams: list[TextStream | None]
    sent_tokens: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or a step broke off half-way: the engine cannot step."""


class _StepFailed(Exception):
    """The model step failed for a reason that leaves the engine able to step again."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True,
                 rank_launcher: RankLauncher | None = None, **kwargs):
        """``rank_launcher`` starts ranks 1..N-1 when ``tensor_parallel_size`` N > 1 (default:
        spawned local processes, one device each)."""
        self.config = config = config or EngineConfig.from_kwargs(**kwargs)
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_path

        model_path = config.model.model or str(default_model_path())
        self.model_name = config.model.model or DEFAULT_MODEL_NAME
        self.hf = HFConfig.load(model_path)
        self.device = _resolve_device(config.device.device)
        tp = config.parallel.tensor_parallel_size
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads or max(1, (os.cpu_count() or 1) // tp))
        if tp > 1:
            hf = self.hf
            check_tp_sizes(tp, num_heads=hf.num_heads, num_kv_heads=hf.num_kv_heads,
                           vocab_size=hf.vocab_size, intermediate_size=hf.intermediate_size)
        elif tp_size() != 1:
            raise RuntimeError("a tensor-parallel engine runs in this process; shut it down "
                               "before starting another engine here (one per process)")
        self.ranks: RankGroup | None = None
        self.failed: BaseException | None = None  # why a tensor-parallel step broke off
        self.max_model_len = _resolve_max_model_len(config.model.max_model_len, self.hf)
        self.tokenizer = load_tokenizer(model_path)
        check_vocab(model_path, self.hf, self.tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids(model_path, self.hf, self.tokenizer))
        self.dtype = dtype = resolve_dtype(config.model.dtype, self.hf.torch_dtype, self.device)
        if tp > 1:
            self._start_ranks(rank_launcher, model_path, dtype)
        try:
            self.runner = ModelRunner(config, self.hf, model_path, self.device, dtype,
                                      self.max_model_len, progress)
        except BaseException:
            self.shutdown(send_exit=False)
            raise
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len,
                                   on_cpu=self.device.type == "cpu")
        self.groups: dict[str, _Group] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.num_batched_tokens_total = 0  # tokens computed: prefill chunks + decode
        self.errors: list[tuple[str, Exception]] = []

    def _start_ranks(self, launcher: RankLauncher | None, model_path: str,
                     dtype: torch.dtype) -> None:
        from engine.tp_ranks import ProcessLauncher, RankGroup

        self.ranks = RankGroup.start(
            launcher or ProcessLauncher(), self.config.parallel.tensor_parallel_size,
            self.device, config=self.config, model_path=model_path,
            dtype=str(dtype).removeprefix("torch."), max_model_len=self.max_model_len)
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    def check_health(self) -> None:
        """Raise ``TensorParallelError`` when a rank has stopped or a step broke the group."""
        if self.failed is not None:
            raise TensorParallelError(f"a tensor-parallel step failed: {self.failed!r}")
        if self.ranks is not None:
            try:
                self.ranks.check()
            except RuntimeError as e:
                raise TensorParallelError(str(e)) from None

    def shutdown(self, send_exit: bool = True) -> None:
        """Stop ranks 1..N-1 (idempotent; nothing to do with one rank). Pass
        ``send_exit=False`` when a step may be running in another thread: the ranks are then
        killed instead of being told to exit."""
        ranks, self.ranks = self.ranks, None
        if ranks is None:
            return
        atexit.unregister(_shutdown_at_exit)
        runner = getattr(self, "runner", None)
        told = send_exit and runner is not None and not runner.tp_broken and self.failed is None
        if told:
            try:
                runner.send_exit()
            except Exception:  # a rank is already gone: stop() kills the rest
                told = False
        ranks.stop(timeout_s=30.0 if told else 0.0)

    def __del__(self) -> None:
        if getattr(self, "ranks", None) is not None:
            self.shutdown()

    # ----------------------------------------------------------------- requests in
    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt; ``ValueError`` naming the problem."""
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.hf.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, "
                                 f"{self.hf.vocab_size - 1}], got {bad[:5]}")
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long; max_model_len is "
                             f"{self.max_model_len}, so prompts may have at most "
                             f"{self.max_model_len - 1} tokens")
        return text, ids

    def check_request(self, prompt: PromptType, params: SamplingParams,
                      ) -> tuple[str | None, list[int]]:
        """Every check ``add_request`` makes, queueing nothing: ``ValueError`` naming the
        problem, else the prompt's text and token ids."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got "
                             f"{type(params).__name__}")
        params.validate()
        outside = [t for t in params.stop_token_ids if t >= self.hf.vocab_size]
        if outside:  # they index the logits: one bad id would fail the whole step
            raise ValueError(f"stop_token_ids must be in [0, {self.hf.vocab_size - 1}], "
                             f"got {outside[:5]}")
        return self.process_prompt(prompt)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None,
                    checked: tuple[str | None, list[int]] | None = None) -> None:
        """Queue a request; ``checked`` is ``check_request``'s answer for the same prompt and
        params, when the caller already has it."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = checked if checked is not None else self.check_request(prompt, params)
        seqs = [Request(request_id if params.n == 1 else f"{request_id}#{i}", ids, params,
                        self.eos_token_ids, index=i, group_id=request_id,
                        arrival_time=arrival_time) for i in range(params.n)]
        for child in seqs[1:]:
            child.parent = seqs[0]
        streams = [TextStream(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                              params.skip_special_tokens) if params.detokenize else None
                   for _ in seqs]
        self.groups[request_id] = _Group(request_id, text, ids, params, seqs, streams,
                                         [0] * params.n, [""] * params.n)
        for seq in seqs:
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(ids)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its blocks; returns its last output, every unfinished
        sequence with finish reason "abort" (None for an unknown or finished request)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        for seq in group.seqs:
            self.scheduler.abort(seq)
            self.runner.sampler.forget(seq.request_id)
        return self._make_output(group)

    def _fail(self, request_id: str, err: Exception) -> None:
        self.abort(request_id)
        self.errors.append((request_id, err))

    def pop_errors(self) -> list[tuple[str, Exception]]:
        """Requests that failed in the last steps, with their errors."""
        errors, self.errors = self.errors, []
        return errors

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        if self.failed is not None:
            raise TensorParallelError(f"a tensor-parallel step failed: {self.failed!r}")
        try:
            reqs, sampled = self._execute(sched)
        except _StepFailed as failed:  # some requests' parts failed: the others go on
            sched, reqs, sampled = self._isolate(sched, failed.error)
        self.scheduler.finish_step(sched)
        self.num_steps += 1
        self.num_batched_tokens_total += sched.num_tokens
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        for i, req in enumerate(reqs):
            if req.group_id not in self.groups:
                continue  # its group failed earlier in this step
            try:
                self._append(req, sampled.token_ids[i], sampled.logprobs[i], now)
            except Exception as e:  # fail this request only
                self._fail(req.group_id, e)
                touched.pop(req.group_id, None)
                continue
            touched[req.group_id] = self.groups[req.group_id]
        outputs = [out for g in touched.values() if (out := self._make_output(g)) is not None]
        for g in touched.values():
            if g.finished:
                del self.groups[g.request_id]
        return outputs

    def _execute(self, sched: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Run the model over ``sched``. A failure that leaves the tensor-parallel ranks out of
        step is fatal (``TensorParallelError``); any other ``Exception`` is ``_StepFailed``."""
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
                 ) -> tuple[SchedulerOutput, list[Request], SamplerOutput]:
        """After a failed step, run each request's part of it alone and fail only the requests
        whose part fails again, so one request's bad input never fails its neighbours. Running a
        part again rewrites the same KV-cache slots with the same values."""
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
                self._fail(group_id, failed.error)
                continue
            kept.scheduled.extend(part)
            if part_out is not None:
                reqs.extend(part_reqs)
                sampled.token_ids.extend(part_out.token_ids)
                sampled.logprobs.extend(part_out.logprobs)
        return kept, reqs, sampled

    def _append(self, req: Request, token: int, logprobs, now: float) -> None:
        req.append_token(token, logprobs)
        self.generation_tokens_total += 1
        if req.first_token_time is None:
            req.first_token_time = now
        finished = req.check_stop(self.max_model_len)
        group = self.groups[req.group_id]
        stream = group.streams[req.index]
        if stream is not None:
            text, stop_str = stream.add([token])
            if stop_str is not None and not finished:
                req.status, req.stop_reason, finished = RequestStatus.FINISHED_STOPPED, stop_str, True
            if finished:
                text += stream.finish()
            group.pending_text[req.index] += text
        if finished:
            self.scheduler.free_finished(req)
            self.runner.sampler.forget(req.request_id)

    def _make_output(self, g: _Group) -> RequestOutput | None:
        kind = g.params.output_kind
        if kind == "final" and not g.finished:
            return None
        outs = []
        for seq in g.seqs:
            sent = g.sent_tokens[seq.index]
            if kind == "delta" and sent == seq.num_output_tokens and not seq.finished:
                continue
            outs.append(self._completion(g, seq, delta=kind == "delta"))
            g.sent_tokens[seq.index] = seq.num_output_tokens
        metrics = group_metrics(g.seqs, time.monotonic()) if g.finished else {}
        return RequestOutput(g.request_id, g.prompt_token_ids, outs, g.finished, g.prompt,
                             num_cached_tokens=g.seqs[0].num_cached_tokens, metrics=metrics)

    def _completion(self, g: _Group, seq: Request, delta: bool) -> CompletionOutput:
        start = g.sent_tokens[seq.index] if delta else 0
        stream = g.streams[seq.index]
        if delta:
            text, g.pending_text[seq.index] = g.pending_text[seq.index], ""
        else:
            text = stream.emitted_text if stream is not None else ""
        logprobs = seq.logprobs[start:] if g.params.logprobs is not None else None
        finish = seq.status.value if seq.finished else None
        return CompletionOutput(seq.index, seq.output_token_ids[start:], text, logprobs, finish,
                                seq.stop_reason)

    # ----------------------------------------------------------------- introspection
    @property
    def vocab_size(self) -> int:
        """Token ids the model accepts: [0, vocab_size)."""
        return self.hf.vocab_size

    def get_stats(self) -> EngineStats:
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_free_blocks": self.kv.num_free_blocks,
            "num_total_blocks": self.kv.num_blocks,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_batched_tokens_total": self.num_batched_tokens_total,
        }


def _shutdown_at_exit(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available (accepted: cpu, auto)")
    return torch.device(name)


def _resolve_max_model_len(requested: int | None, hf: HFConfig) -> int:
    limit = hf.max_position
    if requested is None:
        requested = limit
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is over the model's "
                         f"max_position_embeddings={limit}")
    if hf.sliding_window and requested > hf.sliding_window:
        raise ValueError(f"sliding-window attention is not supported: set max_model_len <= "
                         f"sliding_window={hf.sliding_window} (got {requested})")
    return requested
