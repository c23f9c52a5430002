"""Every policy the comparison runs, by label: ``build(label, ...) -> (policy, Serve config,
Router)``. The labels: ``queue_depth`` (pagedserve's ``QueueDepthPolicy`` with a policy file),
``serve_default_t<target>``, ``knative_kpa``, ``aibrix_kpa``, ``aibrix_apa``, ``llmd_saturation``,
``oracle`` and ``fixed_<n>`` (the runner searches the cheapest ``n``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ray.serve.config import AutoscalingConfig

from load_tests.autoscaling import kpa, llmd
from load_tests.autoscaling.baselines import Oracle, fixed, passthrough, serve_default
from load_tests.autoscaling.fleet import Router
from load_tests.autoscaling.traces import Trace
from serve_app.autoscaling.config import AutoscalingPolicyConfig, load_policy
from serve_app.autoscaling.policy import QueueDepthPolicy

BASELINES = ("knative_kpa", "aibrix_kpa", "aibrix_apa", "llmd_saturation", "oracle")


def policy_spec(policy: str, overrides: dict[str, str], start_s: float) -> AutoscalingPolicyConfig:
    """The policy file with ``overrides``; ``replica_start_s`` (where the policy has it) is the
    simulated start time unless overridden: the operator sets the start time they measured."""
    data = {**load_policy(policy).model_dump(), **overrides}
    if "replica_start_s" in AutoscalingPolicyConfig.model_fields and \
            "replica_start_s" not in overrides:
        data["replica_start_s"] = start_s
    return load_policy(data)


def labels(default_targets: list[float], baselines: list[str]) -> list[str]:
    return (["queue_depth"] + [f"serve_default_t{t:g}" for t in default_targets]
            + list(baselines))


def build(label: str, spec: AutoscalingPolicyConfig, hw: SimpleNamespace, trace: Trace,
          start_s: float) -> tuple[Any, AutoscalingConfig, Router]:
    lo, hi, init = spec.min_replicas, spec.max_replicas, spec.initial_replicas
    if label == "queue_depth":
        router = Router(standby=getattr(spec, "standby_replicas", 0),
                        full_queue=spec.target_queue_per_replica, full_kv=spec.max_kv_usage)
        return (QueueDepthPolicy(**spec.policy_kwargs()),
                AutoscalingConfig(**spec.serve_autoscaling_config()), router)
    if label.startswith("serve_default_t"):
        policy, cfg = serve_default(float(label.removeprefix("serve_default_t")), lo, hi, init)
        return policy, cfg, Router()
    if label.startswith("fixed_"):
        policy, cfg = fixed(int(label.removeprefix("fixed_")))
        return policy, cfg, Router()
    makers = {
        "knative_kpa": lambda: kpa.knative_kpa(hw.max_num_seqs),
        "aibrix_kpa": kpa.aibrix_kpa,
        "aibrix_apa": kpa.APA,
        "llmd_saturation": llmd.SaturationScaler,
        "oracle": lambda: Oracle(trace, hw, start_s),
    }
    if label not in makers:
        raise ValueError(f"policy: unknown {label!r} (known: queue_depth, serve_default_t<n>, "
                         f"fixed_<n>, {', '.join(BASELINES)})")
    return makers[label](), passthrough(lo, hi, init), Router()
