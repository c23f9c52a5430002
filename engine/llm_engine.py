"""``LLMEngine``: the synchronous core. ``add_request`` queues, ``step`` runs one batch and
returns what changed, ``abort`` drops a request and frees its blocks.

The jobs around it live in their own modules: a request's checks and sequences
(``engine.input_processor``, with prompt encoding beside the tokenizer), the step and its failure isolation (``engine.executor.step_executor``), text and
outputs (``engine.core.output_processor``), device, thread and length resolution in
``engine.config``, the tensor-parallel ranks' start and stop in ``engine.executor.tp_ranks``.

With ``tensor_parallel_size`` N > 1 this process is rank 0: it schedules and samples, and starts
ranks 1..N-1 that hold the other shards of the model; ``shutdown`` stops them. With N = 1 there
is no process group and no other process.
"""

from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, configure_kernels
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.output_processor import OutputProcessor, RequestGroup
from engine.core.outputs import RequestOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.stats import EngineStats, StartClock
from engine.executor.model_runner import ModelRunner
from engine.executor.step_executor import StepExecutor, TensorParallelError
from engine.executor.tp_ranks import check_tp_start, start_ranks, stop_ranks
from engine.grammar.compiler import Grammars
from engine.input_processor import InputProcessor
from engine.loader import resolve_dtype
from engine.models.generation_config import default_sampling
from engine.models.hf_config import HFConfig, resolve_max_model_len
from engine.models.hub import locate_model
from engine.tokenizer import PromptType, check_vocab, eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from engine.executor.tp_ranks import RankGroup, RankLauncher

__all__ = ["LLMEngine", "PromptType", "TensorParallelError"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True,
                 rank_launcher: RankLauncher | None = None, **kwargs: object) -> None:
        """``rank_launcher`` starts ranks 1..N-1 when ``tensor_parallel_size`` N > 1 (default:
        spawned local processes, one device each)."""
        clock = StartClock()  # the start's phases (start_phases): the Worker reports them
        self.config = config = config or EngineConfig.from_kwargs(**kwargs)
        model_path, self.model_name = locate_model(config.model)  # its folder, and its name
        self.hf = HFConfig.load(model_path)
        self.device = config.device.resolve_device()
        configure_kernels(config.device)  # before the dtype: it follows the CPU's class
        tp = config.parallel.tensor_parallel_size
        if self.device.type == "cpu":
            torch.set_num_threads(config.device.cpu_threads(share=tp))
        check_tp_start(tp, self.hf)
        self.ranks: RankGroup | None = None
        self.max_model_len = resolve_max_model_len(config.model.max_model_len, self.hf)
        self.tokenizer = load_tokenizer(model_path)
        check_vocab(model_path, self.hf, self.tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids(model_path, self.hf, self.tokenizer))
        self.default_sampling = default_sampling(model_path, config.model.generation_config)
        self.dtype = dtype = resolve_dtype(config.model.dtype, self.hf.torch_dtype, self.device)
        # how the weights are kept: the quantization setting, else the checkpoint's own
        self.quantization = config.model.quantization or (
            self.hf.quantization.label if self.hf.quantization else None)
        if tp > 1:
            self.ranks = start_ranks(rank_launcher, config, self.device, model_path, dtype,
                                     self.max_model_len)
            atexit.register(_shutdown_at_exit, weakref.ref(self))
        try:
            self.runner = ModelRunner(config, self.hf, model_path, self.device, dtype,
                                      self.max_model_len, progress, clock)
        except BaseException:
            self.shutdown(send_exit=False)
            raise
        self.kv_cache_dtype = _dtype_name(self.runner.kv.dtype)
        self.executor = StepExecutor(self.runner)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len,
                                   on_cpu=self.device.type == "cpu")
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        so = config.structured_output
        self.grammars = Grammars(self.tokenizer, self.hf.vocab_size, self.eos_token_ids,
                                 so.grammar_compile_timeout_s, so.grammar_compile_threads)
        self.inputs = InputProcessor(self.tokenizer, self.hf.vocab_size, self.max_model_len,
                                     self.eos_token_ids, self.grammars)
        self.prompt_tokens_total = 0
        self.start_clock = clock  # its start's phases, for the Worker's breakdown
        self.num_steps = self.num_batched_tokens_total = 0  # (tokens: prefill chunks + decode)
        self.errors: list[tuple[str, Exception]] = []

    @property
    def groups(self) -> dict[str, RequestGroup]:
        """Unfinished requests by id."""
        return self.outputs.groups

    @property
    def failed(self) -> BaseException | None:
        """Why a tensor-parallel step broke off (None while the engine can step)."""
        executor = getattr(self, "executor", None)
        return executor.failed if executor is not None else None

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
        ranks, self.ranks = getattr(self, "ranks", None), None
        if ranks is None:
            return
        atexit.unregister(_shutdown_at_exit)
        stop_ranks(ranks, getattr(self, "runner", None), send_exit and self.failed is None)

    def __del__(self) -> None:
        if getattr(self, "ranks", None) is not None:
            self.shutdown()

    # ----------------------------------------------------------------- requests in
    def check_request(self, prompt: PromptType, params: SamplingParams,
                      ) -> tuple[str | None, list[int]]:
        """Every check ``add_request`` makes, queueing nothing: ``ValueError`` naming the
        problem, else the prompt's text and token ids."""
        return self.inputs.check_request(prompt, params)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None,
                    checked: tuple[str | None, list[int]] | None = None) -> None:
        """Queue a request; ``checked`` is ``check_request``'s answer for the same prompt and
        params, when the caller already has it."""
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = checked if checked is not None else self.check_request(prompt, params)
        seqs = self.inputs.sequences(request_id, ids, params, arrival_time)
        self.outputs.add(request_id, text, ids, params, seqs)
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
            self._forget_generator(seq.request_id)
        return self.outputs.make_output(group)

    def _forget_generator(self, request_id: str) -> None:
        """Drop the sequence's seeded generator (the sampler is rank 0's: this process's)."""
        if self.runner.sampler is not None:
            self.runner.sampler.forget(request_id)

    def _fail(self, request_id: str, err: Exception) -> None:
        self.abort(request_id)
        self.errors.append((request_id, err))

    def _fail_grammars(self) -> None:
        """Fail the waiting requests whose grammar did not compile (in time)."""
        self.grammars.expire()
        if self.grammars.take_failed():
            for req, error in self.scheduler.failed_grammars():
                if req.group_id in self.groups:
                    self._fail(req.group_id, error)

    def pop_errors(self) -> list[tuple[str, Exception]]:
        """Requests that failed in the last steps, with their errors."""
        errors, self.errors = self.errors, []
        return errors

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        self._fail_grammars()
        sched = self.scheduler.schedule()
        if not sched.scheduled:  # at most a few ms: requests may wait for their grammars
            self.scheduler.wait_for_grammars(timeout=0.005)
            return []
        sched, reqs, sampled = self.executor.run(sched, self._fail)
        self.scheduler.finish_step(sched)
        self.num_steps += 1
        self.num_batched_tokens_total += sched.num_tokens
        if sampled is None:  # no sequence reached the end of its tokens (a prompt's middle)
            return []
        return self.outputs.process_step(reqs, sampled.token_ids, sampled.logprobs,
                                         self._finished, self._fail)

    def _finished(self, req: Request) -> None:
        self.scheduler.free_finished(req)
        self._forget_generator(req.request_id)

    # ----------------------------------------------------------------- introspection
    @property
    def generation_tokens_total(self) -> int:
        return self.outputs.generation_tokens

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


def _dtype_name(dtype: torch.dtype) -> str:
    """How the KV cache's dtype is reported: "fp8_e4m3" or the dtype's name."""
    return "fp8_e4m3" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def _shutdown_at_exit(ref: weakref.ref[LLMEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
