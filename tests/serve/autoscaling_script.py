"""Scripted inputs for the autoscaling simulator's tests: contexts a policy sees, and a loop that
plays a load script against a policy as Serve's controller would (no fleet, no trace)."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace

from ray.serve._private.common import ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from load_tests.autoscaling.names import KV_USAGE, METRICS, RUNNING, WAITING
from load_tests.autoscaling.sim import DEP, serve_clock


def context(now: float, per_replica: list[dict[str, float]], cfg: AutoscalingConfig,
            target: int | None = None, queued: float = 0.0,
            state: dict | None = None) -> AutoscalingContext:
    """What Serve hands a policy when replica i last reported ``per_replica[i]`` at ``now``
    (the same value as its look-back average; metrics not given are 0)."""
    rids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(len(per_replica))]
    agg = {m: {rid: float(v.get(m, 0.0)) for rid, v in zip(rids, per_replica)} for m in METRICS}
    raw = {m: {rid: [TimeStampedValue(now, x)] for rid, x in vals.items()}
           for m, vals in agg.items()}
    ongoing = sum(v.get(WAITING, 0.0) + v.get(RUNNING, 0.0) for v in per_replica) + queued
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=len(rids), target_num_replicas=len(rids) if target is None else
        target, running_replicas=rids, total_num_requests=ongoing, total_queued_requests=queued,
        aggregated_metrics=agg, raw_metrics=raw, capacity_adjusted_min_replicas=cfg.min_replicas,
        capacity_adjusted_max_replicas=cfg.max_replicas, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=cfg)


def play(policy, cfg: AutoscalingConfig, load: Callable[[float, int], list[dict[str, float]]],
         until: float, start_s: float = 0.0, period: float = 0.5) -> list[tuple[float, int, int]]:
    """Serve's control loop over a load script: every ``period`` the wrapped policy sees
    ``load(t, ready)`` (one metrics dict per ready replica) and its answer becomes the target;
    a new replica is ready ``start_s`` after the decision, a removed one goes at once (newest
    first). Returns ``(t, target, ready)`` per tick."""
    wrapped = _apply_autoscaling_config(policy)
    clock = SimpleNamespace(now=0.0)
    target = cfg.initial_replicas if cfg.initial_replicas is not None else cfg.min_replicas
    ready_at = [0.0] * target
    state: dict = {}
    out = []
    with serve_clock(lambda: clock.now):
        for i in range(int(until / period) + 1):
            clock.now = t = i * period
            ready = sum(1 for r in ready_at if r <= t)
            ctx = context(t, load(t, ready), cfg, target=target, state=state)
            decision, state = wrapped(ctx)
            target = min(max(math.ceil(decision), cfg.min_replicas), cfg.max_replicas)
            ready_at = sorted(ready_at)[:target] + [t + start_s] * (target - len(ready_at))
            out.append((t, target, ready))
    return out


def spread(total: float, ready: int, kv: float = 0.0) -> list[dict[str, float]]:
    """``total`` requests running, spread evenly over ``ready`` replicas, each at KV use ``kv``."""
    return [{RUNNING: total / ready, KV_USAGE: kv} for _ in range(ready)]
