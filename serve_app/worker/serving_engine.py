"""What a Worker needs of its engine (``ServingEngine``), and the engine it builds by default
(``build_engine``: an ``engine.AsyncEngine``, its tensor-parallel ranks as Ray actors)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from ray import serve

from engine import AsyncEngineStats, EngineConfig, SamplingParams, StepStream
from serve_app.config import AppConfig
from serve_app.metrics.worker import EngineStatsSource


class ServingEngine(EngineStatsSource, Protocol):
    """What a Worker uses of its engine (``engine.AsyncEngine`` is one)."""

    model_name: str
    max_model_len: int
    vocab_size: int  # token ids it accepts: [0, vocab_size)
    dtype: Any  # the activations' torch dtype
    quantization: str | None  # the weights' format ("int8", ...); None: in dtype
    kv_cache_dtype: str  # what the KV cache holds: "fp8_e4m3" or the dtype's name
    default_sampling: dict[str, Any]  # generation_config.json's defaults (SamplingParams names)
    tokenizer: Any
    config: EngineConfig

    @property
    def is_running(self) -> bool: ...
    def get_stats(self) -> AsyncEngineStats: ...
    # (request id, prompt token ids, params) requests in, one record per engine step out
    def add_batch(self, requests: Iterable[tuple[str, list[int], SamplingParams]],
                  ) -> StepStream: ...
    def abort(self, request_id: str) -> None: ...
    def check_health(self) -> None: ...  # raises when no request can be served
    def shutdown(self) -> None: ...


def build_engine(config: AppConfig) -> ServingEngine:
    """The default engine: an ``AsyncEngine`` of the config's engine settings; on a CPU, it
    computes with ``worker_threads()`` threads (unless ``num_threads`` is set; the engine's loop
    thread sets torch's count for itself); tensor-parallel ranks 1..N-1 run as Ray actors in
    this replica's placement group."""
    from engine import AsyncEngine

    engine_cfg = config.engine
    if engine_cfg.device.num_threads is None and not config.use_gpu():
        engine_cfg = engine_cfg.model_copy(deep=True)
        engine_cfg.device.num_threads = config.worker_threads()
    return AsyncEngine(engine_cfg, rank_launcher=_rank_launcher(config))


def _rank_launcher(config: AppConfig) -> Any:
    """Starts tensor-parallel ranks 1..N-1 as Ray actors in this replica's placement group
    (None with one rank)."""
    if config.engine.parallel.tensor_parallel_size == 1:
        return None
    from serve_app.worker.tp_ranks import RayRankLauncher

    replica = serve.get_replica_context().replica_id.unique_id
    return RayRankLauncher(f"pagedserve-tp-{replica}", num_cpus=config.worker_num_cpus,
                           num_gpus=1 if config.use_gpu() else 0)
