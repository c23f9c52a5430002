"""The simulator's prediction of one real replay run (``autoscaling_replay.py``).

The same trace, the same policy settings (a policy-file mapping, ``policy: queue_depth`` or
``serve_default``), and a modelled replica fitted to the calibration the replay measured on the
real Worker: ``max_num_seqs`` slots, step time ``step_base_s + step_per_seq_s x running``,
prefill as the idle time to first token, a KV cache that never binds (the replay's prompts are
short), and the replica start time the replay observed.

What the model leaves out, so where the two may part: the Router's dynamic batcher (requests
wait up to ``batch_wait_ms`` before any Worker sees them), CPU contention between replicas on
the same cores (the simulator's replicas never slow each other), and, for Serve's default
policy, the unit it counts: the simulator credits it one ongoing call per request, while in
pagedserve one call carries a Router's whole batch, so the real policy sees fewer.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig

from load_tests.autoscaling.fleet import Router
from load_tests.autoscaling.sim import Sim
from serve_app.autoscaling.config import load_policy
from serve_app.autoscaling.policy import QueueDepthPolicy

KV_TOKENS = 1_000_000  # does not bind for the replay's short prompts


def predict(name: str, policy: dict[str, Any], trace: list[tuple[float, int, int]],
            calib: dict[str, float], start_s: float, slo_s: float,
            max_num_seqs: int) -> dict[str, Any]:
    """One JSON line like the replay's, ``"source": "simulated"``."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    spec = load_policy({**policy, "replica_start_s": policy.get("replica_start_s", start_s)})
    cfg = AutoscalingConfig(**spec.serve_autoscaling_config())
    if spec.policy == "serve_default":
        scaler, router = replica_queue_length_autoscaling_policy, Router()
    else:
        scaler = QueueDepthPolicy(**spec.policy_kwargs())
        router = Router(standby=spec.standby_replicas, full_queue=spec.target_queue_per_replica,
                        full_kv=spec.max_kv_usage)
    hw = SimpleNamespace(max_num_seqs=max_num_seqs, kv_tokens=KV_TOKENS,
                         step_base_s=calib["step_base_s"], step_per_seq_s=calib["step_per_seq_s"])
    prompt_tokens = sum(p for _, p, _ in trace) / max(1, len(trace))
    run = SimpleNamespace(tick_s=0.05, control_period_s=0.5, start_s=start_s,
                          prefill_tokens_per_s=prompt_tokens / max(calib["prefill_s"], 1e-3),
                          ttft_slo_s=slo_s, duration_s=trace[-1][0] if trace else 0.0)
    result = Sim(scaler, cfg, hw, run, router).run(trace)
    return {"policy": name, "source": "simulated", "start_s": start_s, **result}
