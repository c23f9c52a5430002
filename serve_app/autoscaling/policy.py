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
``finished / usage`` in steady states (arrivals within 20% of completions); the estimate kept is
the one taken at the highest per-replica usage in the last ``CAPACITY_MEMORY_S`` (a lightly
loaded replica finishes requests faster than a full one, so the fullest reading is the safest).
``mu = capacity * max_kv_usage`` is what a replica serves at the usage bound. Until a first
reading only the queue and usage rules apply.

The rule, with ``q = target_queue_per_replica``, ``u = max_kv_usage``, ``d =
downscale_threshold``, ``S = replica_start_s``, ``n`` replicas running:

* **up**, from the latest reports and the panic window, to the largest of: the queue rule
  ``ceil((running + queue) / (batch + q))``; the usage rule ``ceil(usage / u)``; the rate rule
  ``ceil(arrivals / mu)``; and the backlog rule ``ceil((arrivals + backlog / S) / capacity)``
  where ``backlog = queue + max(0, arrivals - n * capacity) * S`` is what will wait when the new
  replicas are up, to be cleared within one more start time. One step, not 1 -> 2 -> 4;
* **burst**: the panic window's arrivals at least ``panic_threshold`` times their average over
  ``STABLE_WINDOW_S`` (Knative's 60 s), at least half of ``mu``, and 3 standard deviations of a
  Poisson count above that average. During a burst or an *up*, and for one look-back period
  after, nothing scales down;
* **down**, outside a burst, to the largest of the queue and usage rules at ``d`` times their
  bounds, from the latest reports and the window, and ``ceil(arrivals / (d * mu))`` from the
  window: the rest hold the load with headroom. Serve's ``downscale_delay_s`` then asks for an
  unbroken spell of such answers;
* **floor** (``predictive_floor: trend``): the arrival rate's linear trend over
  ``trend_window_s`` extrapolated ``S`` ahead, in replicas (``ceil(rate / mu)``);
* **zero** when ``min_replicas`` is 0 and nothing arrived, waited or ran, now or in the window;
* **hold** otherwise, and no scale-down while replicas start (their reports are missing).

**Standby**: for ``STANDBY_MEMORY_S`` after a burst, the answer is at least the load in replicas
at full usage (the larger of the usage and ``arrivals / capacity``) plus ``standby_replicas``:
that much capacity stays warm and idle. The Router sends an idle replica kept as standby nothing
until every active one is full (``WorkerRequestRouter``), so a burst is served at once. Smooth
traffic keeps none.

This module is pickled by value into Serve's controller. Of ``serve_app`` it imports only
``serve_app.autoscaling.signals`` (what the policy reads) and
``serve_app.autoscaling.estimators`` (what it learns), both the standard library alone, by
reference.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from serve_app.autoscaling.estimators import Baseline, Capacity, Trend
from serve_app.autoscaling.signals import Load, ceil_

logger = logging.getLogger("ray.serve")

STATE_KEY = "queue_depth_policy"  # our entry in Serve's policy_state
BURST_FLOOR_PER_S = 0.5  # panic-window arrivals below this never make a burst
STANDBY_MEMORY_S = 900.0  # standby replicas are kept this long after the last burst
STABLE_WINDOW_S = 60.0  # a burst is measured against the arrival rate's average over this


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
        self._burst_until = self._last_burst = -math.inf
        self._baseline = Baseline(STABLE_WINDOW_S)
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
        baseline = self._baseline.update(now, window.arrivals)
        # a burst: arrivals at panic_threshold x the baseline, at least half of what one
        # replica serves (once that is known), and beyond Poisson noise: an excess over the
        # baseline of 3 standard deviations of the panic window's count
        floor = 0.5 * self._replicas_rate() if self.capacity.per_usage else BURST_FLOOR_PER_S
        noise = 3.0 * math.sqrt(max(baseline, 0.0) / self.panic_s)
        bursting = short.arrivals >= max(self.panic_threshold * baseline, floor,
                                         baseline + noise)
        if bursting:
            self._last_burst = now
        need = max(self._needed_now(load, arrivals), self._needed_now(short, arrivals),
                   self._floor())
        need = self._with_standby(need, max(load.usage, short.usage), arrivals, now)
        if need > current:
            self._burst_until = now + window.look_back_s
            return "up", need
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
        down = self._with_standby(down, max(load.usage, window.usage), window.arrivals, now)
        if down < current:
            return "down", down
        return "hold", current

    def _with_standby(self, need: int, usage: float, arrivals: float, now: float) -> int:
        """``need`` replicas, or more so that ``standby_replicas`` replicas' worth of capacity
        stays idle beside the load (the load in replicas at full usage, plus the standby)
        while the traffic is bursty: a burst seen in the last ``STANDBY_MEMORY_S``."""
        if not self.standby or now - self._last_burst > STANDBY_MEMORY_S:
            return need
        full = self.capacity.per_usage
        load = max(usage, arrivals / full if full else 0.0)
        return max(need, ceil_(load + self.standby))

    def _needed_now(self, load: Load, arrivals: float) -> int:
        """Replicas the load needs now and once the replicas it starts are up."""
        need = max(load.replicas_for_queue(self.target_queue), ceil_(load.usage / self.max_kv),
                   self._replicas_for_rate(arrivals, 1.0))
        full = self.capacity.per_usage
        if full and arrivals > 0:  # the backlog that builds while new replicas start
            growth = max(0.0, arrivals - load.replicas * full)
            backlog = load.queue + growth * self.start_s
            need = max(need, ceil_((arrivals + backlog / max(self.start_s, 1.0)) / full))
        return need

    def _needed_below_band(self, load: Load) -> int:
        return max(load.replicas_for_queue(self.threshold * self.target_queue),
                   ceil_(load.usage / (self.threshold * self.max_kv)))

    def _replicas_for_rate(self, arrivals: float, fraction: float) -> int:
        """Replicas serving ``arrivals`` requests/s, each at ``fraction`` of the usage bound."""
        full = self.capacity.per_usage
        return ceil_(arrivals / (full * self.max_kv * fraction)) if full and arrivals > 0 else 0

    def _replicas_rate(self) -> float:
        """Requests/s one replica serves at the usage bound (0 until capacity is known)."""
        return (self.capacity.per_usage or 0.0) * self.max_kv

    def _floor(self) -> int:
        if self.trend is None:
            return 0
        return self._replicas_for_rate(self.trend.predict(self.start_s), 1.0)


def _check(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"QueueDepthPolicy: {field} {rule}, got {value!r}")
