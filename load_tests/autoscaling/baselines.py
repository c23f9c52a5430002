"""The simple baselines and what the others share: Ray Serve's default policy, a fixed replica
count and the oracle, plus ``passthrough`` and ``Sampler`` for the baselines that are not Serve
policies (``kpa.py``, ``llmd.py``).

What each baseline sees. All run in the same simulator, behind Serve's ``_apply_autoscaling_config``
wrapper, on the same ``AutoscalingContext``. Serve's default policy runs with Serve's own
defaults. The others (Knative, AIBrix, llm-d, fixed, oracle) bring their own windows, delays
and rate limits, so their Serve config is ``passthrough``: no up or down delay, scaling factors
of 1, so that only Serve's bounds and its start-from-zero path act on their answer; and their
replicas push metrics every second (Knative's autoscaler scrapes each pod every second; llm-d and
AIBrix read Prometheus, at least as fresh). Each records its own history from the replicas'
latest reports once a second (``Sampler``) instead of Serve's look-back average.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig

from load_tests.autoscaling.names import KV_USAGE, RUNNING, WAITING
from load_tests.autoscaling.traces import Trace


def serve_default(target: float, min_replicas: int, max_replicas: int,
                  initial: int | None = None) -> tuple[Any, AutoscalingConfig]:
    """Ray Serve's default policy (``replica_queue_length_autoscaling_policy``, Ray 2.60): desired
    = running replicas x (ongoing requests / (``target_ongoing_requests`` x running replicas)),
    i.e. ``ceil(ongoing / target)`` after Serve's rounding, where ongoing is the look-back
    average of requests at the replicas plus those queued at the handles. With Serve's published
    defaults for everything but the target and the bounds: ``upscale_delay_s`` 30,
    ``downscale_delay_s`` 600, ``look_back_period_s`` 30, ``metrics_interval_s`` 10, scaling
    factors 1 (``ray.serve.config.AutoscalingConfig``). It is credited with one ongoing call per
    request; in pagedserve one call carries a whole batch, so it would see fewer."""
    cfg = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                            initial_replicas=initial, target_ongoing_requests=target)
    return replica_queue_length_autoscaling_policy, cfg


def passthrough(min_replicas: int, max_replicas: int, initial: int | None = None,
                look_back_period_s: float = 10.0) -> AutoscalingConfig:
    """Serve's wrapper with nothing of its own: no delays, factors 1, metrics every second."""
    return AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                             initial_replicas=initial, upscale_delay_s=0.0,
                             downscale_delay_s=0.0, downscale_to_zero_delay_s=0.0,
                             look_back_period_s=look_back_period_s, metrics_interval_s=1.0)


def fixed(n: int) -> tuple[Any, AutoscalingConfig]:
    """``n`` replicas from the start, never scaled."""
    return (lambda ctx: (n, {})), passthrough(n, n, n)


def latest(ctx: Any, name: str) -> dict[Any, float]:
    """Each running replica's last report of metric ``name``."""
    running = set(ctx.running_replicas)
    series = (ctx.raw_metrics or {}).get(name) or {}
    return {rid: s[-1].value for rid, s in series.items() if rid in running and s}


class Sampler:
    """A once-a-second history of what a baseline reads: ``(t, {replica: (queue, running, kv)})``
    from the replicas' latest reports, plus the Router's held requests; ``keep_s`` long."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s, self.next_t = keep_s, 0.0
        self.points: deque[tuple[float, dict, float]] = deque()

    def update(self, ctx: Any) -> None:
        now = ctx.current_time
        if now < self.next_t:
            return
        self.next_t = now + 1.0
        w, r, kv = latest(ctx, WAITING), latest(ctx, RUNNING), latest(ctx, KV_USAGE)
        per = {rid: (w.get(rid, 0.0), r.get(rid, 0.0), kv.get(rid, 0.0)) for rid in kv}
        self.points.append((now, per, float(ctx.total_queued_requests or 0.0)))
        while self.points and self.points[0][0] <= now - self.keep_s:
            self.points.popleft()

    def window(self, now: float, span_s: float) -> list[tuple[float, dict, float]]:
        return [p for p in self.points if p[0] > now - span_s]


class Oracle:
    """The lower bound: a policy that knows every future arrival.

    From the trace it computes, second by second, the replicas the load needs: each request
    occupies a sequence for ``output x step time`` seconds, where the step time is the replica's
    at its capacity batch ``C = min(max_num_seqs, 0.9 x kv_tokens / mean(prompt + output))``;
    ``need(t) = ceil(concurrent requests at t / C)``. At time t it asks for the most that will be
    needed in ``[t, t + start_s + lead_s]``, so every replica is up ``start_s`` before the load
    that needs it arrives, and goes as soon as no load within a start time needs it. It runs
    behind ``passthrough`` (no delays). It is a bound on cost, not a guarantee of the SLO: a
    replica's batch can be less efficient than ``C`` implies.
    """

    def __init__(self, trace: Trace, hw: Any, start_s: float, lead_s: float = 2.0) -> None:
        self.need = oracle_need(trace, hw)
        self.ahead = int(math.ceil(start_s + lead_s))

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        t = int(ctx.current_time)
        window = self.need[t: t + self.ahead + 1]
        return (int(window.max()) if len(window) else 0), {}


def oracle_need(trace: Trace, hw: Any) -> np.ndarray:
    """Replicas needed in each second of the trace (see ``Oracle``)."""
    if not trace:
        return np.zeros(1, dtype=np.int64)
    arr = np.array(trace, dtype=np.float64)
    footprint = float(np.mean(arr[:, 1] + arr[:, 2]))
    cap = max(1, min(hw.max_num_seqs, int(0.9 * hw.kv_tokens / footprint)))
    step_s = hw.step_base_s + hw.step_per_seq_s * cap
    start, end = arr[:, 0], arr[:, 0] + arr[:, 2] * step_s
    n = int(math.ceil(end.max())) + 2
    delta = np.zeros(n + 1)
    np.add.at(delta, np.floor(start).astype(int), 1)
    np.add.at(delta, np.ceil(end).astype(int), -1)
    busy = np.cumsum(delta)[:n]
    return np.ceil(busy / cap - 1e-9).astype(np.int64)
