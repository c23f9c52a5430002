"""Runs the model: builds it, binds its KV cache, runs each step's forward and samples.

The step's batch is laid out by ``engine.executor.batch_layout``, the cache's memory is
``engine.executor.kv_cache_tensor``'s, and with tensor parallelism the step travels to ranks 1..N-1 as
``engine.executor.step_message`` describes: rank 0 (the engine's process) schedules, lays the batch out
and broadcasts it; ranks 1..N-1 wait for it in ``serve_steps``. Every rank then runs the same
forward (the layers' collectives keep them in step) and the LM head gathers the logits on
rank 0, which alone samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, configure_kernels
from engine.core.request import Request
from engine.core.scheduler import SchedulerOutput
from engine.core.stats import StartClock
from engine.distributed import broadcast_cpu, tp_rank, tp_size
from engine.executor import step_message
from engine.executor.batch_layout import HostBatch, lay_out
from engine.executor.cpu_runtime import keep_freed_memory
from engine.executor.kv_cache_tensor import KVCacheTensor, kv_budget_bytes, kv_cache_dtype
from engine.layers.attention import Attention, expect_kv_scales, finish_kv_scales
from engine.layers.context import AttentionMetadata, set_context
from engine.layers.embedding import ParallelLMHead
from engine.layers.linear import LinearBase
from engine.layers.quantization import expect_quantized_linears, finish_quantized_linears
from engine.loader import load_weights
from engine.models.hf_config import HFConfig
from engine.models.registry import CausalLM, model_class
from engine.sample.sampler import Sampler, SamplerOutput, sample_peak
from kernels import ops

if TYPE_CHECKING:
    from engine.executor.cuda_graphs import DecodeGraphs


class ModelRunner:
    def __init__(self, config: EngineConfig, hf: HFConfig, model_path: str,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 progress: bool = True, clock: StartClock | None = None):
        """``clock`` gets the start's phases: engine_setup, model_init, weight_load, pack,
        warm_up, kv_alloc (the profiling forward on CUDA and the zeroed cache), cuda_graphs."""
        self.clock = clock = clock or StartClock()
        clock.mark("engine_setup")  # (the LLMEngine's: config, tokenizer, tensor-parallel ranks)
        self.config, self.hf, self.device, self.dtype = config, hf, device, dtype
        hf.max_model_len = max_model_len  # the model's rotary embedding may read it
        configure_kernels(config.device)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.tp = tp_size()
        self.tp_broken = False  # a step's collectives were interrupted: the group is unusable
        if device.type == "cpu":
            keep_freed_memory()
        self.model = self._build_model(model_path, progress)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv = KVCacheTensor(self.attn_layers, self.block_size,
                                kv_cache_dtype(config.cache, dtype, device), device)
        budget = kv_budget_bytes(config.cache, device, self._profile_run,
                                 self._profile_graph_pool if self._use_graphs() else None)
        self.num_blocks = self.kv.allocate(budget, max_model_len)
        self.sampler = Sampler(config.model.seed, device) if tp_rank() == 0 else None
        clock.mark("kv_alloc")
        self.graphs = self._capture_graphs() if self._use_graphs() else None
        clock.mark("cuda_graphs")

    # ----------------------------------------------------------------- start-up
    def _build_model(self, model_path: str, progress: bool) -> CausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(self.hf.architecture)(self.hf)
        finally:
            torch.set_default_dtype(default_dtype)
        self.clock.mark("model_init")
        checkpoint_quant = self.hf.quantization
        if checkpoint_quant is not None:
            expect_quantized_linears(model, checkpoint_quant.weight_type,
                                     checkpoint_quant.packed)
            if checkpoint_quant.kv_scales:
                expect_kv_scales(model)
        load_weights(model, model_path, progress=progress)
        self.clock.mark("weight_load")
        if checkpoint_quant is not None:
            finish_quantized_linears(model)
            if checkpoint_quant.kv_scales:
                finish_kv_scales(model, self.config.cache.kv_cache_dtype != "auto")
        if self.config.model.quantization is not None:
            model.quantize_weights(self.config.model.quantization)
        model.pack_weights()
        self.clock.mark("pack")
        self._warm_up_packed(model)
        self.clock.mark("warm_up")
        return model.eval()

    def _warm_up_packed(self, model: CausalLM) -> None:
        """Prepacked CPU matmuls: build oneDNN's kernels for the row counts of decode steps
        (up to 256 rows) where the product is small; the others are built on first use."""
        packed = [(m.packed, getattr(m, "bias", None)) for m in model.modules()
                  if isinstance(m, (LinearBase, ParallelLMHead)) and m.packed is not None]
        rows = min(256, self.config.scheduler.max_num_batched_tokens)
        if packed:
            ops.warm_up_packed(packed, rows)

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """The KV-cache tensor (None while released)."""
        return self.kv.tensor

    def _profile_run(self, tokens: int | None = None, sample: bool = True) -> None:
        """One forward over a full token budget (or ``tokens``), on a throw-away cache just big
        enough, then the heaviest sampling of its logits: the activation memory a step can
        take."""
        n = tokens or min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-n // self.block_size)
        self.kv.bind(num_blocks)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=dev),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_query_len=n, max_seq_len=n)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        with torch.inference_mode(), set_context(meta):
            hidden = self.model(ids, torch.arange(n, device=dev))
            logits = self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
            if logits is not None and sample:
                sample_peak(logits)
        del hidden, logits
        self.kv.release()

    def _profile_graph_pool(self) -> None:
        """The forward the largest CUDA graph captures (its pool keeps that much)."""
        from engine.executor.cuda_graphs import batch_buckets

        self._profile_run(batch_buckets(self.config.scheduler.max_num_seqs)[-1], sample=False)

    def _use_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.device.enforce_eager

    def _capture_graphs(self) -> DecodeGraphs:
        from engine.executor.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.hf.hidden_size,
                              self.config.scheduler.max_num_seqs,
                              -(-self.max_model_len // self.block_size), self.max_model_len,
                              self.dtype, self.device)
        graphs.capture()
        return graphs

    # ----------------------------------------------------------------- one step
    def prepare(self, sched: SchedulerOutput,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, HostBatch]:
        batch = lay_out(sched, self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(batch.slot_mapping).to(dev),
            block_tables=torch.from_numpy(batch.block_tables).to(dev),
            seq_lens=torch.from_numpy(batch.seq_lens).to(dev),
            query_start_loc=torch.from_numpy(batch.query_start_loc).to(dev),
            max_query_len=batch.max_query_len,
            max_seq_len=int(batch.seq_lens.max()),
        )
        input_ids = torch.from_numpy(batch.input_ids).to(dev)
        pos_t = torch.from_numpy(batch.positions).to(dev)
        return input_ids, pos_t, meta, batch

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(num_seqs, meta):
            return self.graphs.run(input_ids, positions, meta)
        with set_context(meta):
            return self.model(input_ids, positions)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        if self.tp > 1:
            return self._execute_tp(sched)
        input_ids, positions, meta, batch = self.prepare(sched)
        hidden = self._forward(input_ids, positions, meta, len(sched.scheduled))
        if not batch.sample_idx:
            return [], None
        logits = self.model.compute_logits(hidden[batch.sample_idx])
        assert logits is not None and self.sampler is not None  # a single rank is rank 0
        return batch.sample_reqs, self.sampler(logits, batch.sample_reqs, batch.prompt_rows)

    # ----------------------------------------------------------------- tensor parallelism
    def _execute_tp(self, sched: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Rank 0: broadcast the step, run it like every other rank, sample."""
        batch = lay_out(sched, self.block_size)
        header, body = step_message.pack(batch)
        self.tp_broken = True
        broadcast_cpu(header)
        broadcast_cpu(body)
        logits = self._run_step(header, body)
        self.tp_broken = False
        if logits is None:
            return [], None
        assert self.sampler is not None
        return batch.sample_reqs, self.sampler(logits, batch.sample_reqs, batch.prompt_rows)

    def _run_step(self, header: torch.Tensor, body: torch.Tensor) -> torch.Tensor | None:
        """Every rank: unpack a step message, run the forward; logits on rank 0 (else None)."""
        ids, positions, meta, sample_idx = step_message.unpack(header, body, self.device)
        hidden = self._forward(ids, positions, meta, meta.seq_lens.shape[0])
        return self.model.compute_logits(hidden[sample_idx]) if len(sample_idx) else None

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Ranks 1..N-1: run the steps rank 0 broadcasts until it sends the exit message."""
        header = torch.empty(step_message.HEADER, dtype=torch.long)
        while True:
            broadcast_cpu(header)
            if header[0].item() == step_message.EXIT:
                return
            body = step_message.empty_body(header)
            broadcast_cpu(body)
            self._run_step(header, body)

    def send_exit(self) -> None:
        """Rank 0: tell ranks 1..N-1 to leave ``serve_steps``."""
        broadcast_cpu(step_message.exit_header())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's weights as stored: the parameters still held (prepacking
    releases a plain copy), prepacked oneDNN tensors, packed int8 values and their scales."""
    seen: set[int] = set()
    held: list[torch.Tensor | None] = list(model.parameters())
    for m in model.modules():
        if isinstance(m, (LinearBase, ParallelLMHead)):
            packed = m.packed.data if isinstance(m.packed, ops.DensePacked) else m.packed
            held += [packed, m.weight_scale, *(m.int8[:2] if m.int8 is not None else ())]
    total = 0
    for t in held:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
