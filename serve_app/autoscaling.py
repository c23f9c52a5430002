"""``QueueDepthPolicy``: the Worker deployment's Ray Serve autoscaling policy (Ray 2.60 API).

Serve's default policy counts ongoing handle calls, but one call to a Worker carries a whole
batch and a replica with a full KV cache looks no busier than an idle one. This policy reads what
each Worker reports in ``record_autoscaling_stats()`` instead.

Serve builds the class once per deployment, ``QueueDepthPolicy(**policy_kwargs)``, and calls it
on every control-loop tick with an ``AutoscalingContext``; it returns ``(replicas, state)``.
Serve wraps the call: it starts the first replica itself when calls queue for a deployment at
zero, and it applies the scaling factors, ``upscale_delay_s`` / ``downscale_delay_s`` /
``downscale_to_zero_delay_s`` and ``min_replicas`` / ``max_replicas`` to the answer.

Inputs, summed over the running replicas, each read twice: as the replicas' latest reports
(``ctx.raw_metrics``) and averaged over ``look_back_period_s`` (``ctx.aggregated_metrics``):

* ``queue`` = requests waiting in the replicas' schedulers + batch calls queued at the Routers'
  handles (``ctx.total_queued_requests``, non-zero when every replica is busy or none runs);
* ``running`` = requests being generated; ``batch`` = ``running`` per running replica;
* ``usage`` = the sum over replicas of how full each is: the larger of its KV-cache usage and
  its sequence-slot usage (running / ``max_num_seqs``), in units of one replica.

The rule, with ``t`` the current target, ``q = target_queue_per_replica``, ``u = max_kv_usage``
and ``d = downscale_threshold``:

* **up** to ``max(ceil((running + queue) / (batch + q)), ceil(usage / u))`` from the latest
  reports, when that is above ``t``: the replicas needed so that, each running a batch like
  today's, at most ``q`` requests wait per replica (0 when nothing waits), and so that no
  replica is fuller than ``u``. Reading the latest reports lets a burst show at once rather than
  diluted in the window's average;
* **down** to ``max(ceil((running + queue) / (batch + d * q)), ceil(usage / (d * u)), 1)``, the
  larger from the latest reports and from the window, when that is below ``t``: fewer replicas
  would still keep the queue and their fullness well under the bounds;
* **zero** when ``min_replicas`` is 0 and nothing waited, ran or queued, now or in the window;
* **hold** at ``t`` otherwise, and while replicas are starting (fewer run than ``t``: the
  missing reports say nothing about idleness or surplus).

Time hysteresis is Serve's: its delay logic scales only after the same direction has been
answered without a break for the delay, and a *hold* resets it. So replicas go down only after
the queue has been short and the cache not full for ``downscale_delay_s``, and the last one goes
only after ``downscale_to_zero_delay_s`` (the policy file's ``idle_timeout_s``) of idleness.

This module is pickled by value into Serve's controller: it imports nothing from ``serve_app``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("ray.serve")

# Metric names reported by Worker.record_autoscaling_stats().
WAITING, RUNNING, KV_USAGE, SLOT_USAGE, TOKENS_PER_S = (
    "num_waiting", "num_running", "kv_cache_usage", "seq_slot_usage", "output_tokens_per_s")
FINISHED_PER_S = "finished_per_s"  # requests finished per second on the replica
# The Routers' demand, forwarded by every Worker (each reports the same sums over the Routers'
# fresh reports, so the policy takes the largest report, not the sum over replicas).
DEMAND_ARRIVALS, DEMAND_PROMPT_TPS, DEMAND_WAITING = (
    "demand_arrivals_per_s", "demand_prompt_tokens_per_s", "demand_router_waiting")
STATE_KEY = "queue_depth_policy"  # our entry in Serve's policy_state


class QueueDepthPolicy:
    """Replica count from queue depth and KV-cache usage (see the module docstring)."""

    def __init__(self, target_queue_per_replica: float = 4.0, max_kv_usage: float = 0.9,
                 downscale_threshold: float = 0.5, **_: Any) -> None:
        _check(target_queue_per_replica > 0, "target_queue_per_replica", "must be > 0",
               target_queue_per_replica)
        _check(0 < max_kv_usage <= 1, "max_kv_usage", "must be in (0, 1]", max_kv_usage)
        _check(0 < downscale_threshold < 1, "downscale_threshold", "must be in (0, 1)",
               downscale_threshold)
        self.target_queue = float(target_queue_per_replica)
        self.max_kv = float(max_kv_usage)
        self.threshold = float(downscale_threshold)
        self._last_decision: tuple[str, int] = ("", -1)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        window, load = Load.from_context(ctx), Load.from_context(ctx, latest=True)
        current = ctx.target_num_replicas
        decision, replicas = self.decide(load, window, current, ctx.capacity_adjusted_min_replicas)
        replicas = min(max(replicas, ctx.capacity_adjusted_min_replicas),
                       ctx.capacity_adjusted_max_replicas)
        if replicas == current:
            decision = "hold"  # e.g. 'up' at max_replicas
        if (decision, replicas) != self._last_decision:  # log changes, not every tick
            self._last_decision = (decision, replicas)
            logger.info("QueueDepthPolicy: %s %d -> %d (%s)", decision, current, replicas, load)
        state = dict(ctx.policy_state or {})
        state[STATE_KEY] = {"decision": decision, "desired": replicas, **load.as_dict(),
                            "window": window.as_dict()}
        return replicas, state

    def decide(self, load: Load, window: Load, current: int,
               min_replicas: int) -> tuple[str, int]:
        """``(decision, replicas)`` before bounds: 'up', 'down', 'zero' or 'hold'.

        ``load`` is the replicas' latest reports, ``window`` their look-back averages: up reacts
        to the latest (Serve's upscale delay filters noise); down and zero need both quiet.
        """
        up = max(load.replicas_for_queue(self.target_queue), _ceil(load.usage / self.max_kv))
        if up > current:
            return "up", up
        if window.replicas < current:
            return "hold", current  # replicas still starting: no reports from them yet
        if min_replicas == 0 and load.idle() and window.idle():
            return ("zero", 0) if current > 0 else ("hold", 0)
        down = max(self._needed_below_band(load), self._needed_below_band(window), 1)
        if down < current:
            return "down", down
        return "hold", current

    def _needed_below_band(self, load: Load) -> int:
        return max(load.replicas_for_queue(self.threshold * self.target_queue),
                   _ceil(load.usage / (self.threshold * self.max_kv)))


class Load:
    """A deployment's load summed over its running replicas: their look-back averages, or
    (``latest``) each one's last report."""

    __slots__ = ("queue", "running", "usage", "tokens_per_s", "replicas")

    def __init__(self, queue: float = 0.0, running: float = 0.0, usage: float = 0.0,
                 tokens_per_s: float = 0.0, replicas: int = 0) -> None:
        self.queue, self.running, self.usage = queue, running, usage
        self.tokens_per_s, self.replicas = tokens_per_s, replicas

    @classmethod
    def from_context(cls, ctx: Any, latest: bool = False) -> Load:
        metrics = (_last_values(ctx.raw_metrics) if latest else None) or \
            ctx.aggregated_metrics or {}
        running_ids = set(ctx.running_replicas or ())

        def per_replica(name: str) -> dict[Any, float]:
            return {rid: v for rid, v in (metrics.get(name) or {}).items() if rid in running_ids}

        def total(name: str) -> float:
            return float(sum(per_replica(name).values()))

        kv, slots = per_replica(KV_USAGE), per_replica(SLOT_USAGE)
        usage = sum(max(v, slots.get(rid, 0.0)) for rid, v in kv.items())
        queued_at_handles = float(ctx.total_queued_requests or 0.0)
        return cls(queue=total(WAITING) + queued_at_handles, running=total(RUNNING),
                   usage=usage, tokens_per_s=total(TOKENS_PER_S),
                   replicas=ctx.current_num_replicas)

    def idle(self) -> bool:
        return self.queue <= 0 and self.running <= 0

    def replicas_for_queue(self, queue_per_replica: float) -> int:
        """Fewest replicas leaving at most ``queue_per_replica`` waiting on each, when each runs
        a batch as large as the running replicas do now; 0 when nothing waits."""
        if self.queue <= 0:
            return 0
        batch = self.running / self.replicas if self.replicas else 0.0
        return _ceil((self.running + self.queue) / (batch + queue_per_replica))

    def as_dict(self) -> dict[str, float]:
        return {k: round(float(getattr(self, k)), 3) for k in self.__slots__}

    def __repr__(self) -> str:
        return (f"queue={self.queue:.1f} running={self.running:.1f} usage={self.usage:.2f} "
                f"tokens/s={self.tokens_per_s:.0f} on {self.replicas} replicas")


def _last_values(raw: dict[str, dict[Any, Any]] | None) -> dict[str, dict[Any, float]]:
    """Each replica's last reported value per metric, from ``ctx.raw_metrics`` time series."""
    return {name: {rid: series[-1].value for rid, series in per_replica.items() if series}
            for name, per_replica in (raw or {}).items()}


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 2.0000000001 from float sums is 2, not 3


def _check(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"QueueDepthPolicy: {field} {rule}, got {value!r}")
