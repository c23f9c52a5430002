"""What the exported metrics are called, which labels they carry, and their histogram buckets.

Two spellings, chosen by ``AppConfig.metrics_naming``:

- ``pagedserve`` (the default): ``pagedserve_<name>`` with the labels ``model_name`` and
  ``replica`` (Serve's replica id). Counters end in ``_total`` in the name itself.
- ``vllm``: the series vLLM has keep vLLM's own names as Ray Serve LLM exports them:
  ``vllm:<name>`` with ':' made '_' (``vllm_num_requests_running``), counters without ``_total``
  (Ray's exporter adds it: ``ray_vllm_generation_tokens_total``), and the labels ``model_name``,
  ``engine`` ("0") and ``ReplicaId``. Ray's own Serve LLM dashboard and autoscaling policies
  that read those series then work unchanged. The series only pagedserve has keep their
  ``pagedserve_`` names, with the same labels as the rest.

Ray's exporter puts ``ray_`` before every name (``EXPORT_PREFIX``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricsNaming = Literal["pagedserve", "vllm"]
EXPORT_PREFIX = "ray_"  # what Ray's exporter puts before every name

# pagedserve's name -> vLLM's (without its "vllm:" prefix), for the series vLLM has.
VLLM_NAMES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "cache_config_info": "cache_config_info",
    "prompt_tokens_total": "prompt_tokens",
    "generation_tokens_total": "generation_tokens",
    "prefix_cache_queries_total": "prefix_cache_queries",
    "prefix_cache_hits_total": "prefix_cache_hits",
    "num_preemptions_total": "num_preemptions",
    "request_success_total": "request_success",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "request_inference_time_seconds": "request_inference_time_seconds",
    "request_prefill_time_seconds": "request_prefill_time_seconds",
    "request_decode_time_seconds": "request_decode_time_seconds",
    "request_time_per_output_token_seconds": "request_time_per_output_token_seconds",
    "request_prompt_tokens": "request_prompt_tokens",
    "request_generation_tokens": "request_generation_tokens",
    "iteration_tokens_total": "iteration_tokens_total",
}

# The counters (Ray's exporter gives a counter's name ``_total`` if it lacks it).
COUNTERS = frozenset({"prompt_tokens_total", "generation_tokens_total",
                      "prefix_cache_queries_total", "prefix_cache_hits_total",
                      "num_preemptions_total", "request_success_total",
                      "router_requests_rejected_total", "http_requests_total"})


@dataclass(frozen=True)
class Naming:
    """One spelling of the metrics: ``name(key)`` is what a series is created as in Ray."""

    scheme: MetricsNaming = "pagedserve"

    def name(self, key: str) -> str:
        if self.scheme == "vllm" and key in VLLM_NAMES:
            return "vllm_" + VLLM_NAMES[key]
        return "pagedserve_" + key

    def exported(self, key: str) -> str:
        """The name Prometheus sees (a counter's gets ``_total`` if it lacks it)."""
        name = EXPORT_PREFIX + self.name(key)
        return name + "_total" if key in COUNTERS and not name.endswith("_total") else name

    @property
    def replica_label(self) -> str:
        return "ReplicaId" if self.scheme == "vllm" else "replica"

    @property
    def labels(self) -> tuple[str, ...]:
        if self.scheme == "vllm":
            return ("model_name", "engine", "ReplicaId")
        return ("model_name", "replica")

    def tags(self, model_name: str, replica: str) -> dict[str, str]:
        if self.scheme == "vllm":
            return {"model_name": model_name, "engine": "0", "ReplicaId": replica}
        return {"model_name": model_name, "replica": replica}


# Histogram buckets, in seconds unless named otherwise.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
               0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0]
QUEUE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 80.0, 160.0, 320.0, 640.0]
STEP_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                         50000, 100000]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
