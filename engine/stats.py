"""What ``LLMEngine.get_stats`` (``EngineStats``) and ``AsyncEngine.get_stats``
(``AsyncEngineStats``) report."""

from __future__ import annotations

from typing import TypedDict


class EngineStats(TypedDict):
    num_running: int  # requests (sequences) running in the current step
    num_waiting: int  # queued, not yet admitted (preempted ones included)
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float  # share of blocks in use, 0..1
    prefix_cache_queries: int  # prompt blocks looked up in the prefix cache
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_batched_tokens_total: int  # tokens computed: prefill chunks + decode


class AsyncEngineStats(EngineStats):
    output_tokens_per_s: float  # over the last 10 s of the AsyncEngine's step loop
