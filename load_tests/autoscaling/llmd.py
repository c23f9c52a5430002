"""llm-d's saturation-based scaling (the workload-variant-autoscaler's saturation analyzer), as a
policy for the simulator.

Source: llm-d-incubation/workload-variant-autoscaler, ``docs/saturation-analyzer.md`` and
``docs/capacity-scaling-config.md`` (its ConfigMap defaults, the same thresholds as the
inference scheduler's saturation detector: ``kvCacheUtilThreshold`` 0.8, ``queueDepthThreshold``
5), and ``GLOBAL_OPT_INTERVAL`` (60 s) for how often it runs.

Every ``interval_s`` (60 s), from each ready replica's peak over the last minute (the analyzer
queries ``max_over_time[1m]``) of its KV-cache usage and its waiting requests:

* a replica is saturated when KV >= ``kv_threshold`` (0.8) or queue >= ``queue_threshold`` (5);
* over the others, spare KV = 0.8 - KV and spare queue = 5 - queue, averaged;
* **up** to ready + 1 when the average spare KV < ``kv_spare_trigger`` (0.1) or the average
  spare queue < ``queue_spare_trigger`` (3) (or every replica is saturated);
* **down** to ready - 1 when at least two replicas are not saturated and, their summed KV and
  queue spread over one replica fewer, the spare KV stays >= 0.1 and the spare queue >= 3;
* else ready.

Counting ready replicas only (those that report) keeps it from adding more while one starts. The
answer goes to Serve unchanged (``passthrough``); in llm-d an HPA or KEDA object applies it,
whose own stabilization windows are not modelled.
"""

from __future__ import annotations

from typing import Any

from load_tests.autoscaling.baselines import Sampler


class SaturationScaler:
    def __init__(self, kv_threshold: float = 0.8, queue_threshold: float = 5.0,
                 kv_spare_trigger: float = 0.1, queue_spare_trigger: float = 3.0,
                 interval_s: float = 60.0, peak_window_s: float = 60.0) -> None:
        self.kv_t, self.q_t = kv_threshold, queue_threshold
        self.kv_trig, self.q_trig = kv_spare_trigger, queue_spare_trigger
        self.interval_s, self.peak_s = interval_s, peak_window_s
        self.sampler = Sampler(peak_window_s + 1)
        self.desired: int | None = None
        self.next_run = 0.0
        self.info: dict[str, Any] = {}

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        now = ctx.current_time
        self.sampler.update(ctx)
        if self.desired is None or now >= self.next_run:
            self.next_run = now + self.interval_s
            self.desired = self.decide(self.peaks(now), ctx.current_num_replicas,
                                       ctx.target_num_replicas)
        return self.desired, {"saturation": dict(self.info)}

    def peaks(self, now: float) -> dict[Any, tuple[float, float]]:
        """Each replica's (peak KV usage, peak queue) over the last minute."""
        out: dict[Any, tuple[float, float]] = {}
        for _, per, _ in self.sampler.window(now, self.peak_s):
            for rid, (q, _, kv) in per.items():
                k0, q0 = out.get(rid, (0.0, 0.0))
                out[rid] = (max(k0, kv), max(q0, q))
        return out

    def decide(self, peaks: dict[Any, tuple[float, float]], ready: int, current: int) -> int:
        if not peaks:
            return current
        free = [(kv, q) for kv, q in peaks.values() if kv < self.kv_t and q < self.q_t]
        if not free:
            self.info = {"saturated": len(peaks), "action": "up"}
            return ready + 1
        spare_kv = sum(self.kv_t - kv for kv, _ in free) / len(free)
        spare_q = sum(self.q_t - q for _, q in free) / len(free)
        action, target = "hold", ready
        if spare_kv < self.kv_trig or spare_q < self.q_trig:
            action, target = "up", ready + 1
        elif len(free) >= 2:
            n = len(free) - 1
            kv_after = self.kv_t - sum(kv for kv, _ in free) / n
            q_after = self.q_t - sum(q for _, q in free) / n
            if kv_after >= self.kv_trig and q_after >= self.q_trig:
                action, target = "down", ready - 1
        self.info = {"spare_kv": round(spare_kv, 3), "spare_queue": round(spare_q, 2),
                     "action": action}
        return target
