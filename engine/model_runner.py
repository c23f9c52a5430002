"""Builds each step's flat batch, runs the model over it and samples.

The batch is every scheduled request's new tokens laid end to end: ``input_ids`` and
``positions`` ``[T]``, the cache ``slot_mapping`` ``[T]``, ``block_tables`` ``[B, max_blocks]``,
``seq_lens`` and ``query_start_loc`` (cu_seqlens of the queries). Logits are computed only for
the last token of requests whose new tokens reach the end of their sequence.

With tensor parallelism, rank 0 (the engine's process) schedules, lays the batch out and
broadcasts it as one int64 message (``_HEADER`` sizes, then the arrays end to end) over gloo;
ranks 1..N-1 wait for it in ``serve_steps``. Every rank then runs the same forward (the layers'
collectives keep them in step) and the LM head gathers the logits on rank 0, which alone samples.
A message of kind ``_EXIT`` ends ``serve_steps``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.config import EngineConfig
from engine.context import AttentionMetadata, set_context
from engine.cpu_runtime import keep_freed_memory
from engine.distributed import all_reduce_min, broadcast_cpu, tp_rank, tp_size
from engine.layers.attention import Attention
from engine.layers.sampler import Sampler, SamplerOutput
from engine.loader import load_weights
from engine.models.hf_config import HFConfig
from engine.models.registry import model_class
from engine.request import Request
from engine.scheduler import SchedulerOutput
from kernels import cpu_gemm

DEFAULT_CPU_KV_BYTES = 1 << 30

# Step message: kind, num_tokens, num_seqs, max_blocks, num_sampled, max_query_len, max_seq_len.
_HEADER = 7
_EXIT, _STEP = 0, 1


class _Batch(NamedTuple):
    """One step laid out on the host, before it goes to the device."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [B, max_blocks] int32
    seq_lens: np.ndarray  # [B] int32
    query_start_loc: np.ndarray  # [B + 1] int32
    max_query_len: int
    sample_idx: list[int]  # rows of the hidden states that get logits
    sample_reqs: list[Request]


class ModelRunner:
    def __init__(self, config: EngineConfig, hf: HFConfig, model_path: str,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 progress: bool = True):
        self.config, self.hf, self.device, self.dtype = config, hf, device, dtype
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.tp = tp_size()
        self.tp_broken = False  # a step's collectives were interrupted: the group is unusable
        if device.type == "cpu":
            keep_freed_memory()
        self.model = self._build_model(model_path, progress)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_blocks = self._allocate_kv_cache()
        self.sampler = Sampler(config.model.seed, device) if tp_rank() == 0 else None
        self.graphs = self._capture_graphs() if self._use_graphs() else None

    # ----------------------------------------------------------------- start-up
    def _build_model(self, model_path: str, progress: bool) -> torch.nn.Module:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(self.hf.architecture)(self.hf)
        finally:
            torch.set_default_dtype(default_dtype)
        load_weights(model, model_path, progress=progress)
        model.pack_weights()
        self._warm_up_packed(model)
        return model.eval()

    def _warm_up_packed(self, model: torch.nn.Module) -> None:
        """Prepacked CPU matmuls: build oneDNN's kernels for the row counts of decode steps
        (up to 256 rows: cheap products); a larger bucket's is built when a step first uses it."""
        packed = [(m.packed, getattr(m, "bias", None))
                  for m in model.modules() if getattr(m, "packed", None) is not None]
        if packed:
            cpu_gemm.warm_up(packed, min(256, self.config.scheduler.max_num_batched_tokens))

    def kv_bytes_per_block(self) -> int:
        attn = self.attn_layers[0]
        per_layer = 2 * self.block_size * attn.num_kv_heads * attn.head_dim
        return per_layer * len(self.attn_layers) * self.dtype.itemsize

    def _kv_budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        return int(total * cache.gpu_memory_utilization - (total - free) - activation_peak)

    def _profile_run(self) -> None:
        """One forward over a full token budget, on a throw-away cache just big enough, to
        measure the activation memory a step can take."""
        n = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-n // self.block_size)
        self._bind_kv_cache(num_blocks)
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
            self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs :])
        del hidden
        self.kv_cache = None

    def _bind_kv_cache(self, num_blocks: int) -> None:
        attn = self.attn_layers[0]
        # K and V of a layer are each one contiguous [num_blocks, block_size, Hk, D] tensor, so a
        # block is one contiguous run of memory (gathers on the CPU copy whole blocks).
        shape = (len(self.attn_layers), 2, num_blocks, self.block_size, attn.num_kv_heads,
                 attn.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache = self.kv_cache[i, 0]
            layer.v_cache = self.kv_cache[i, 1]

    def _allocate_kv_cache(self) -> int:
        per_block = self.kv_bytes_per_block()
        num_blocks = all_reduce_min(self._kv_budget_bytes() // per_block, self.device)
        needed_blocks = -(-self.max_model_len // self.block_size)
        if num_blocks < needed_blocks:
            raise ValueError(
                f"KV cache too small: {max(num_blocks, 0)} blocks of {self.block_size} tokens "
                f"hold fewer than max_model_len={self.max_model_len} tokens; one sequence needs "
                f"{needed_blocks * per_block} bytes (kv_cache_memory_bytes or "
                "gpu_memory_utilization), or lower max_model_len")
        self._bind_kv_cache(num_blocks)
        return num_blocks

    def _use_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.device.enforce_eager

    def _capture_graphs(self):
        from engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.hf.hidden_size,
                              self.config.scheduler.max_num_seqs,
                              -(-self.max_model_len // self.block_size), self.max_model_len,
                              self.dtype, self.device)
        graphs.capture()
        return graphs

    # ----------------------------------------------------------------- one step
    def _lay_out(self, sched: SchedulerOutput) -> _Batch:
        bs = self.block_size
        ids: list[int] = []
        positions, slots = [], []
        seq_lens, q_starts = [], [0]
        sample_idx: list[int] = []
        sample_reqs: list[Request] = []
        max_blocks = max(len(r.block_ids) for r, _ in sched.scheduled)
        tables = np.zeros((len(sched.scheduled), max_blocks), dtype=np.int32)
        for b, (req, n) in enumerate(sched.scheduled):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids.extend(req.all_token_ids[start:end])
            table = np.asarray(req.block_ids, dtype=np.int64)
            tables[b, : len(table)] = table
            pos = np.arange(start, end)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            seq_lens.append(end)
            q_starts.append(q_starts[-1] + n)
            if end == req.num_tokens:
                sample_idx.append(q_starts[-1] - 1)
                sample_reqs.append(req)
        return _Batch(np.array(ids, dtype=np.int64), np.concatenate(positions),
                      np.concatenate(slots), tables, np.array(seq_lens, dtype=np.int32),
                      np.array(q_starts, dtype=np.int32), max(n for _, n in sched.scheduled),
                      sample_idx, sample_reqs)

    def prepare(self, sched: SchedulerOutput):
        batch = self._lay_out(sched)
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
        return input_ids, pos_t, meta, batch.sample_idx, batch.sample_reqs

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
        input_ids, positions, meta, sample_idx, sample_reqs = self.prepare(sched)
        hidden = self._forward(input_ids, positions, meta, len(sched.scheduled))
        if not sample_reqs:
            return [], None
        logits = self.model.compute_logits(hidden[sample_idx])
        return sample_reqs, self.sampler(logits, sample_reqs)

    # ----------------------------------------------------------------- tensor parallelism
    def _execute_tp(self, sched: SchedulerOutput) -> tuple[list[Request], SamplerOutput | None]:
        """Rank 0: broadcast the step, run it like every other rank, sample."""
        batch = self._lay_out(sched)
        b, max_blocks = batch.block_tables.shape
        header = torch.tensor([_STEP, len(batch.input_ids), b, max_blocks, len(batch.sample_idx),
                               batch.max_query_len, int(batch.seq_lens.max())])
        body = torch.from_numpy(np.concatenate([
            batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables.ravel(),
            batch.seq_lens, batch.query_start_loc, batch.sample_idx]).astype(np.int64))
        self.tp_broken = True
        broadcast_cpu(header)
        broadcast_cpu(body)
        logits = self._run_step(header, body)
        self.tp_broken = False
        if logits is None:
            return [], None
        return batch.sample_reqs, self.sampler(logits, batch.sample_reqs)

    def _run_step(self, header: torch.Tensor, body: torch.Tensor) -> torch.Tensor | None:
        """Every rank: unpack a step message, run the forward; logits on rank 0 (else None)."""
        _, t, b, max_blocks, s, max_query_len, max_seq_len = header.tolist()
        ids, positions, slots, tables, seq_lens, q_starts, sample_idx = body.to(self.device).split(
            [t, t, t, b * max_blocks, b, b + 1, s])
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(b, max_blocks).int(),
                                 seq_lens=seq_lens.int(), query_start_loc=q_starts.int(),
                                 max_query_len=max_query_len, max_seq_len=max_seq_len)
        hidden = self._forward(ids, positions, meta, b)
        return self.model.compute_logits(hidden[sample_idx]) if s else None

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Ranks 1..N-1: run the steps rank 0 broadcasts until it sends ``_EXIT``."""
        header = torch.empty(_HEADER, dtype=torch.long)
        while True:
            broadcast_cpu(header)
            kind, t, b, max_blocks, s = header[:5].tolist()
            if kind == _EXIT:
                return
            body = torch.empty(3 * t + b * max_blocks + 2 * b + 1 + s, dtype=torch.long)
            broadcast_cpu(body)
            self._run_step(header, body)

    def send_exit(self) -> None:
        """Rank 0: tell ranks 1..N-1 to leave ``serve_steps``."""
        broadcast_cpu(torch.full((_HEADER,), _EXIT, dtype=torch.long))
