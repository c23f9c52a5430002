"""What ``QueueDepthPolicy`` reads: the metric names the Workers report, and ``Load``, a
deployment's load over its running replicas from an ``AutoscalingContext``. Standard library
only: Serve's controller imports it (``serve_app.autoscaling.policy`` refers to it by reference)."""

from __future__ import annotations

import math
from typing import Any

# Metric names reported by Worker.record_autoscaling_stats().
WAITING, RUNNING, KV_USAGE, SLOT_USAGE, TOKENS_PER_S = (
    "num_waiting", "num_running", "kv_cache_usage", "seq_slot_usage", "output_tokens_per_s")
FINISHED_PER_S = "finished_per_s"  # requests finished per second on the replica
# The Routers' demand, forwarded by every Worker (each reports the same sums over the Routers'
# fresh reports, so the policy takes the largest report, not the sum over replicas).
DEMAND_ARRIVALS, DEMAND_PROMPT_TPS, DEMAND_WAITING = (
    "demand_arrivals_per_s", "demand_prompt_tokens_per_s", "demand_router_waiting")


class Load:
    """A deployment's load over its running replicas: the look-back averages, or each
    replica's reports since a time (``since=inf``: its last report only)."""

    __slots__ = ("queue", "running", "usage", "tokens_per_s", "finished", "arrivals",
                 "prompt_tokens_per_s", "replicas", "look_back_s")

    def __init__(self, queue: float = 0.0, running: float = 0.0, usage: float = 0.0,
                 tokens_per_s: float = 0.0, finished: float = 0.0, arrivals: float = 0.0,
                 prompt_tokens_per_s: float = 0.0, replicas: int = 0,
                 look_back_s: float = 30.0) -> None:
        self.queue, self.running, self.usage = queue, running, usage
        self.tokens_per_s, self.finished, self.arrivals = tokens_per_s, finished, arrivals
        self.prompt_tokens_per_s, self.replicas = prompt_tokens_per_s, replicas
        self.look_back_s = look_back_s

    @classmethod
    def from_context(cls, ctx: Any, since: float | None = None) -> Load:
        metrics = (_recent_means(ctx.raw_metrics, since) if since is not None else None) or \
            ctx.aggregated_metrics or {}
        running_ids = set(ctx.running_replicas or ())

        def per_replica(name: str) -> dict[Any, float]:
            return {rid: v for rid, v in (metrics.get(name) or {}).items() if rid in running_ids}

        def total(name: str) -> float:
            return float(sum(per_replica(name).values()))

        def largest(name: str) -> float:  # the same forwarded sums on every replica
            return float(max(per_replica(name).values(), default=0.0))

        kv, slots = per_replica(KV_USAGE), per_replica(SLOT_USAGE)
        usage = sum(max(v, slots.get(rid, 0.0)) for rid, v in kv.items())
        # requests the Routers hold: their own count includes the calls queued at their
        # handles (Serve's total_queued_requests), so the larger of the two, not the sum
        queued = max(float(ctx.total_queued_requests or 0.0), largest(DEMAND_WAITING))
        config = getattr(ctx, "config", None)
        return cls(queue=total(WAITING) + queued, running=total(RUNNING), usage=usage,
                   tokens_per_s=total(TOKENS_PER_S), finished=total(FINISHED_PER_S),
                   arrivals=largest(DEMAND_ARRIVALS),
                   prompt_tokens_per_s=largest(DEMAND_PROMPT_TPS),
                   replicas=ctx.current_num_replicas,
                   look_back_s=float(getattr(config, "look_back_period_s", 30.0) or 30.0))

    def idle(self) -> bool:
        return self.queue <= 0 and self.running <= 0 and self.arrivals <= 0

    def replicas_for_queue(self, queue_per_replica: float) -> int:
        """Fewest replicas leaving at most ``queue_per_replica`` waiting on each, when each runs
        a batch as large as the running replicas do now; 0 when nothing waits."""
        if self.queue <= 0:
            return 0
        batch = self.running / self.replicas if self.replicas else 0.0
        return ceil_((self.running + self.queue) / (batch + queue_per_replica))

    def as_dict(self) -> dict[str, float]:
        return {k: round(float(getattr(self, k)), 3) for k in self.__slots__}

    def __repr__(self) -> str:
        return (f"queue={self.queue:.1f} running={self.running:.1f} usage={self.usage:.2f} "
                f"arrivals={self.arrivals:.2f}/s finished={self.finished:.2f}/s "
                f"on {self.replicas} replicas")


def _recent_means(raw: dict[str, dict[Any, Any]] | None, since: float,
                  ) -> dict[str, dict[Any, float]]:
    """Per metric and replica, the mean of the reports at or after ``since`` (the last report
    alone when none is that recent, or when ``since`` is infinite)."""
    out: dict[str, dict[Any, float]] = {}
    for name, per_replica in (raw or {}).items():
        out[name] = {}
        for rid, series in per_replica.items():
            if series:
                recent = [p.value for p in series if p.timestamp >= since] or [series[-1].value]
                out[name][rid] = sum(recent) / len(recent)
    return out


def ceil_(x: float) -> int:
    """``ceil`` that reads 2.0000000001 from float sums as 2, not 3."""
    return math.ceil(x - 1e-9)
