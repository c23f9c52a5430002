"""``QueueDepthPolicy``: the Worker deployment's Ray Serve autoscaling policy (Ray 2.60 API).

Serve's default policy counts ongoing handle calls, but one call to a Worker carries a whole
batch and a replica with a full KV cache looks no busier than an idle one. This policy reads what
the Workers report in ``record_autoscaling_stats()`` instead, and the Routers' demand, which the
Workers forward: demand shows at a Router before any engine feels it.

Serve builds the class once per deployment, ``QueueDepthPolicy(**policy_kwargs)``, and calls it
on every control-loop tick with an ``AutoscalingContext``; it returns ``(replicas, state)``.
Serve wraps the call: it starts the first replica itself when calls queue for a deployment at
zero, and it applies ``upscale_delay_s`` / ``downscale_delay_s`` / ``downscale_to_zero_delay_s``
and ``min_replicas`` / ``max_replicas`` to the answer.

Signals (``Load``), over the running replicas, read three ways: each replica's latest report, the
reports of the short *panic window* (``panic_window_s``) and Serve's average over
``look_back_period_s`` (the stable window):

* ``queue``: requests waiting in the Workers' schedulers, plus those the Routers hold that no
  Worker has yet (their report, which counts calls queued at their handles, or Serve's count
  of those calls when larger);
* ``running``; ``usage``: per replica the larger of its KV-cache use and its sequence-slot use,
  summed (units of one full replica); ``finished``: requests finished per second;
* ``arrivals``: requests per second accepted by the Routers (the leading signal).

Capacity (``Capacity``): requests per second one replica finishes per unit of usage, learnt from
``finished / usage``; the estimate kept is the one taken at the highest per-replica usage seen in
the last ``CAPACITY_MEMORY_S`` (a lightly loaded replica finishes requests faster than a full
one, so the fullest observation is the safest). ``mu = capacity * max_kv_usage`` is what a
replica serves at the usage bound. Until a first observation only the queue rules apply.

The rule, with ``q = target_queue_per_replica``, ``u = max_kv_usage``, ``d =
downscale_threshold``, ``S = replica_start_s``, ``n`` replicas running:

* **up**, from the latest reports and the panic window, to the largest of: the queue rule
  ``ceil((running + queue) / (batch + q))``; the usage rule ``ceil(usage / u)``; the rate rule
  ``ceil(arrivals / mu)``; and the backlog rule ``ceil((arrivals + backlog / S) / capacity)``
  where ``backlog = queue + max(0, arrivals - n * capacity) * S`` is what will wait when the new
  replicas are up, to be cleared within one more start time. One step, not 1 -> 2 -> 4;
* **burst**: while the panic window's arrivals are ``panic_threshold`` times the stable
  window's, or the answer is *up*, and for one stable window after, nothing scales down;
* **down**, outside a burst, to the largest of the queue and usage rules at ``d`` times their
  bounds, from the latest reports and the window, and ``ceil(arrivals / (d * mu))`` from the
  window: the rest hold the load with headroom. Serve's ``downscale_delay_s`` then asks for an
  unbroken spell of such answers;
* **floor** (``predictive_floor: trend``): the arrival rate's linear trend over
  ``trend_window_s`` extrapolated ``S`` ahead, in replicas (``ceil(rate / mu)``);
* **zero** when ``min_replicas`` is 0 and nothing arrived, waited or ran, now or in the window;
* **hold** otherwise, and no scale-down while replicas start (their reports are missing).

The answer adds ``standby_replicas`` warm replicas to what the load needs: started and loaded,
the Router sends them nothing until every active replica is full (``WorkerRequestRouter``).

This module is pickled by value into Serve's controller. Of ``serve_app`` it imports only
``serve_app.autoscaling_estimators`` (the standard library alone), by reference.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from serve_app.autoscaling_estimators import Capacity, Trend

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
BURST_FLOOR_PER_S = 0.5  # panic-window arrivals below this never make a burst


class QueueDepthPolicy:
    """Replica count from the Routers' demand, queue depth and KV-cache usage (module doc)."""

    def __init__(self, target_queue_per_replica: float = 4.0, max_kv_usage: float = 0.9,
                 downscale_threshold: float = 0.5, replica_start_s: float = 30.0,
                 panic_window_s: float = 6.0, panic_threshold: float = 2.0,
                 standby_replicas: int = 0, predictive_floor: str = "none",
                 trend_window_s: float = 120.0, **_: Any) -> None:
        _check(target_queue_per_replica > 0, "target_queue_per_replica", "must be > 0",
               target_queue_per_replica)
        _check(0 < max_kv_usage <= 1, "max_kv_usage", "must be in (0, 1]", max_kv_usage)
        _check(0 < downscale_threshold < 1, "downscale_threshold", "must be in (0, 1)",
               downscale_threshold)
        _check(replica_start_s >= 0, "replica_start_s", "must be >= 0", replica_start_s)
        _check(panic_window_s > 0, "panic_window_s", "must be > 0", panic_window_s)
        _check(panic_threshold > 1, "panic_threshold", "must be > 1", panic_threshold)
        _check(standby_replicas >= 0, "standby_replicas", "must be >= 0", standby_replicas)
        _check(predictive_floor in ("none", "trend"), "predictive_floor",
               "must be 'none' or 'trend'", predictive_floor)
        self.target_queue = float(target_queue_per_replica)
        self.max_kv = float(max_kv_usage)
        self.threshold = float(downscale_threshold)
        self.start_s, self.panic_s = float(replica_start_s), float(panic_window_s)
        self.panic_threshold, self.standby = float(panic_threshold), int(standby_replicas)
        self.capacity = Capacity()
        self.trend = Trend(trend_window_s) if predictive_floor == "trend" else None
        self._burst_until = -math.inf
        self._last_decision: tuple[str, int] = ("", -1)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        now = ctx.current_time or time.time()
        window, load = Load.from_context(ctx), Load.from_context(ctx, since=math.inf)
        short = Load.from_context(ctx, since=now - self.panic_s)
        current = ctx.target_num_replicas
        decision, replicas = self.decide(load, short, window, current,
                                         ctx.capacity_adjusted_min_replicas, now)
        replicas = min(max(replicas, ctx.capacity_adjusted_min_replicas),
                       ctx.capacity_adjusted_max_replicas)
        if replicas == current:
            decision = "hold"  # e.g. 'up' at max_replicas
        if (decision, replicas) != self._last_decision:  # log changes, not every tick
            self._last_decision = (decision, replicas)
            logger.info("QueueDepthPolicy: %s %d -> %d (%s)", decision, current, replicas, load)
        state = dict(ctx.policy_state or {})
        state[STATE_KEY] = {"decision": decision, "desired": replicas, **load.as_dict(),
                            "capacity": round(self.capacity.per_usage or 0.0, 3),
                            "burst": now < self._burst_until, "window": window.as_dict()}
        return replicas, state

    def decide(self, load: Load, short: Load, window: Load, current: int, min_replicas: int,
               now: float | None = None) -> tuple[str, int]:
        """``(decision, replicas)`` before bounds: 'up', 'down', 'zero' or 'hold'.

        ``load`` is the replicas' latest reports, ``short`` the panic window's, ``window``
        Serve's look-back averages. The count includes the standby replicas.
        """
        now = time.time() if now is None else now
        self.capacity.observe(window, now)
        arrivals = short.arrivals  # the panic window: a 2 s rate is mostly Poisson noise
        if self.trend is not None:
            self.trend.add(now, window.arrivals)
        need = max(self._needed_now(load, arrivals), self._needed_now(short, arrivals),
                   self._floor())
        bursting = short.arrivals >= max(self.panic_threshold * window.arrivals,
                                         BURST_FLOOR_PER_S)
        if need + self.standby > current:
            self._burst_until = now + window.look_back_s
            return "up", need + self.standby
        if bursting:
            self._burst_until = now + window.look_back_s
        if window.replicas < current:
            return "hold", current  # replicas still starting: no reports from them yet
        if min_replicas == 0 and load.idle() and window.idle() and short.idle():
            return ("zero", 0) if current > 0 else ("hold", 0)
        if now < self._burst_until:
            return "hold", current
        down = max(self._needed_below_band(load), self._needed_below_band(window),
                   self._replicas_for_rate(window.arrivals, self.threshold), self._floor(), 1)
        if down + self.standby < current:
            return "down", down + self.standby
        return "hold", current

    def _needed_now(self, load: Load, arrivals: float) -> int:
        """Replicas the load needs now and once the replicas it starts are up."""
        need = max(load.replicas_for_queue(self.target_queue), _ceil(load.usage / self.max_kv),
                   self._replicas_for_rate(arrivals, 1.0))
        full = self.capacity.per_usage
        if full and arrivals > 0:  # the backlog that builds while new replicas start
            growth = max(0.0, arrivals - load.replicas * full)
            backlog = load.queue + growth * self.start_s
            need = max(need, _ceil((arrivals + backlog / max(self.start_s, 1.0)) / full))
        return need

    def _needed_below_band(self, load: Load) -> int:
        return max(load.replicas_for_queue(self.threshold * self.target_queue),
                   _ceil(load.usage / (self.threshold * self.max_kv)))

    def _replicas_for_rate(self, arrivals: float, fraction: float) -> int:
        """Replicas serving ``arrivals`` requests/s, each at ``fraction`` of the usage bound."""
        full = self.capacity.per_usage
        return _ceil(arrivals / (full * self.max_kv * fraction)) if full and arrivals > 0 else 0

    def _floor(self) -> int:
        if self.trend is None:
            return 0
        return self._replicas_for_rate(self.trend.predict(self.start_s), 1.0)


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
        return _ceil((self.running + self.queue) / (batch + queue_per_replica))

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


def _ceil(x: float) -> int:
    return math.ceil(x - 1e-9)  # 2.0000000001 from float sums is 2, not 3


def _check(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"QueueDepthPolicy: {field} {rule}, got {value!r}")
