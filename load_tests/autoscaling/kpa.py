"""Knative's Pod Autoscaler and AIBrix's KPA and APA, as policies for the simulator.

**Knative KPA** (knative.dev/docs/serving/autoscaling/kpa-specific and the ``config-autoscaler``
ConfigMap's defaults; the algorithm of ``pkg/autoscaler/scaling/autoscaler.go``). Every tick
(2 s) it averages the observed concurrency over the stable window (``stable-window`` 60 s) and
over the panic window (``panic-window-percentage`` 10% of it, 6 s) and asks for
``ceil(average / target)`` pods from each, each bounded by the rate limits
(``max-scale-up-rate`` 1000: at most 1000x the ready pods; ``max-scale-down-rate`` 2: at most
down to half). When the panic-window count reaches ``panic-threshold-percentage`` 200% of the
ready pods it enters panic: it scales on the panic window, never below the most it asked for in
this panic, and it leaves panic only after a stable window without reaching the threshold.
Otherwise it scales on the stable window. ``scale-down-delay`` (0 s by default) holds the
highest answer for that long before a scale-down. The target is
``container-concurrency-target-percentage`` 70% of ``containerConcurrency``, set here to the
replica's ``max_num_seqs`` (the most one pod runs at once), so 44.8 for 64 slots.
``target-burst-capacity`` 200 decides whether Knative's activator sits in the request path
(when ``ready pods x containerConcurrency - panic concurrency < 200``); it is computed and kept in
the policy state, but changes nothing here: the simulated Router already holds requests while no
replica can take them and hands each to the least loaded replica, which is what the activator
adds. Concurrency = requests in the replicas (waiting and running, each replica's latest report)
plus those the Router holds (the activator's, which Knative counts too).

**AIBrix KPA** (vllm-project/aibrix ``pkg/controller/podautoscaler``: ``algorithm/kpa.go`` is a
port of Knative's, ``context/context.go`` and ``metrics/client.go`` its defaults): the same
algorithm with AIBrix's defaults: stable window 180 s, panic window 60 s, panic threshold 2.0,
max scale-up rate 2 and scale-down rate 2, and a 300 s scale-down cooldown (the highest
recommendation of the last 300 s is kept before scaling down). The metric is the KV-cache usage
summed over the pods with a per-pod target of 0.5 (AIBrix's examples scale vLLM on
``gpu_cache_usage_perc`` with target 50%).

**AIBrix APA** (``algorithm/apa.go``): with ``u`` the per-pod mean KV usage (Serve's look-back
average) and target ``t``: above ``t x (1 + 0.1)`` (the up-fluctuation tolerance) it asks for
``ceil(pods x u / t)`` (at most 2x the pods), below ``t x (1 - 0.2)`` (the down tolerance of its
documented APA example) the same formula (at least half the pods), else it holds; the same 300 s
scale-down cooldown. Its **linear-trend floor** (``prediction/predictor.go``): a least-squares
line through the per-pod metric samples of the observation window (180 s; at least 3 samples
spanning at least half of it), projected from their mean 120 s ahead, capped at 4x the mean and
at 0 below, turned into pods by the same formula; the answer is the larger of the reactive and
the projected count. Samples are taken every 10 s (an assumption; AIBrix records one per
reconcile). AIBrix's pending-replica guard is not modelled.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from load_tests.autoscaling.baselines import Sampler
from load_tests.autoscaling.names import KV_USAGE


class KPA:
    """Knative's KPA decision (see the module docstring); ``metric`` is "concurrency" (Knative)
    or "kv" (AIBrix: KV usage summed over pods)."""

    def __init__(self, target: float, stable_window_s: float = 60.0,
                 panic_window_pct: float = 10.0, panic_threshold: float = 2.0,
                 max_scale_up_rate: float = 1000.0, max_scale_down_rate: float = 2.0,
                 scale_down_delay_s: float = 0.0, target_burst_capacity: float = 200.0,
                 container_concurrency: float = 0.0, metric: str = "concurrency",
                 tick_s: float = 2.0) -> None:
        self.target, self.stable_s = target, stable_window_s
        self.panic_s = stable_window_s * panic_window_pct / 100.0
        self.panic_threshold, self.up_rate, self.down_rate = (
            panic_threshold, max_scale_up_rate, max_scale_down_rate)
        self.delay_s, self.tbc, self.cc = scale_down_delay_s, target_burst_capacity, \
            container_concurrency
        self.metric, self.tick_s = metric, tick_s
        self.sampler = Sampler(stable_window_s + 1)
        self.panic_since: float | None = None
        self.max_panic_pods = 0
        self.recent: deque[tuple[float, int]] = deque()  # (t, answer) for the scale-down delay
        self.desired: int | None = None
        self.next_tick = 0.0
        self.info: dict[str, Any] = {}

    def observe(self, point: tuple[float, dict, float]) -> float:
        _, per, held = point
        if self.metric == "kv":
            return sum(kv for _, _, kv in per.values())
        return sum(q + r for q, r, _ in per.values()) + held

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        now = ctx.current_time
        self.sampler.update(ctx)
        if self.desired is None or now >= self.next_tick:
            self.next_tick = now + self.tick_s
            self.desired = self.decide(now, ctx.current_num_replicas, ctx.target_num_replicas)
        return self.desired, {"kpa": dict(self.info)}

    def decide(self, now: float, ready_count: int, current: int) -> int:
        stable = [self.observe(p) for p in self.sampler.window(now, self.stable_s)]
        panic = [self.observe(p) for p in self.sampler.window(now, self.panic_s)]
        if not stable:
            return current
        ready = max(1, ready_count)
        up, down = math.ceil(self.up_rate * ready), math.floor(ready / self.down_rate)
        observed_stable, observed_panic = float(np.mean(stable)), float(np.mean(panic or stable))
        dspc = min(max(math.ceil(observed_stable / self.target - 1e-9), down), up)
        dppc = min(max(math.ceil(observed_panic / self.target - 1e-9), down), up)
        if dppc / ready >= self.panic_threshold:
            self.panic_since = now  # enter, or stay: the stable window restarts
        elif self.panic_since is not None and now >= self.panic_since + self.stable_s:
            self.panic_since, self.max_panic_pods = None, 0
        desired = dspc
        if self.panic_since is not None:
            self.max_panic_pods = max(self.max_panic_pods, dppc)
            desired = self.max_panic_pods  # never down while panicking
        if self.delay_s > 0:
            self.recent.append((now, desired))
            while self.recent[0][0] <= now - self.delay_s:
                self.recent.popleft()
            desired = max(d for _, d in self.recent)
        self.info = {"stable": round(observed_stable, 3), "panic": round(observed_panic, 3),
                     "in_panic": self.panic_since is not None, "desired": desired,
                     "excess_burst_capacity": math.floor(ready * self.cc - observed_panic
                                                         - self.tbc) if self.cc else None}
        return desired


def knative_kpa(max_num_seqs: int) -> KPA:
    """Knative's defaults, ``containerConcurrency`` = the replica's sequence slots."""
    return KPA(target=0.7 * max_num_seqs, container_concurrency=max_num_seqs)


def aibrix_kpa() -> KPA:
    """AIBrix's KPA defaults on KV-cache usage, target 0.5 per pod."""
    return KPA(target=0.5, stable_window_s=180.0, panic_window_pct=100.0 * 60 / 180,
               max_scale_up_rate=2.0, max_scale_down_rate=2.0, scale_down_delay_s=300.0,
               metric="kv")


class APA:
    """AIBrix's APA with its linear-trend floor (see the module docstring)."""

    def __init__(self, target: float = 0.5, up_tolerance: float = 0.1,
                 down_tolerance: float = 0.2, max_scale_up_rate: float = 2.0,
                 max_scale_down_rate: float = 2.0, cooldown_s: float = 300.0,
                 observe_window_s: float = 180.0, horizon_s: float = 120.0,
                 sample_s: float = 10.0, predictive: bool = True) -> None:
        self.target, self.up_tol, self.down_tol = target, up_tolerance, down_tolerance
        self.up_rate, self.down_rate, self.cooldown_s = (
            max_scale_up_rate, max_scale_down_rate, cooldown_s)
        self.window_s, self.horizon_s, self.sample_s = observe_window_s, horizon_s, sample_s
        self.predictive = predictive
        self.samples: deque[tuple[float, float]] = deque()  # (t, per-pod mean)
        self.recent: deque[tuple[float, int]] = deque()
        self.next_sample = 0.0

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        now, pods = ctx.current_time, ctx.current_num_replicas
        kv = {r: v for r, v in (ctx.aggregated_metrics or {}).get(KV_USAGE, {}).items()
              if r in set(ctx.running_replicas)}
        if not kv or not pods:
            return ctx.target_num_replicas, {}
        use = sum(kv.values()) / len(kv)
        if now >= self.next_sample:
            self.next_sample = now + self.sample_s
            self.samples.append((now, use))
            while self.samples[0][0] <= now - self.window_s:
                self.samples.popleft()
        desired = self.reactive(pods, use)
        projected = self.projection(use) if self.predictive else None
        if projected is not None:
            desired = max(desired, math.ceil(pods * projected / self.target - 1e-9))
        self.recent.append((now, desired))
        while self.recent[0][0] <= now - self.cooldown_s:
            self.recent.popleft()
        if desired < pods:  # the scale-down cooldown keeps the highest recent answer
            desired = min(pods, max(d for _, d in self.recent))
        return desired, {"apa": {"use": round(use, 3), "projected": projected}}

    def reactive(self, pods: int, use: float) -> int:
        ratio = use / self.target
        want = math.ceil(pods * ratio - 1e-9)
        if ratio > 1 + self.up_tol:
            return min(want, math.ceil(self.up_rate * pods))
        if ratio < 1 - self.down_tol:
            return max(want, math.floor(pods / self.down_rate))
        return pods

    def projection(self, observed_now: float) -> float | None:
        """AIBrix's linear predictor over the observation window, or None without enough data."""
        if len(self.samples) < 3:
            return None
        t = np.array([s[0] for s in self.samples])
        v = np.array([s[1] for s in self.samples])
        if t[-1] - t[0] < 0.5 * self.window_s or np.ptp(t) == 0:
            return None
        slope = float(np.polyfit(t - t[0], v, 1)[0])
        mean = float(v.mean())
        predicted = max(0.0, mean + slope * self.horizon_s)
        return min(predicted, 4.0 * mean) if mean > 0 else predicted
