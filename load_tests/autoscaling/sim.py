"""One run: a trace through the modelled fleet under one policy, as Serve's controller runs it.

Every ``control_period_s`` the policy sees a real ``AutoscalingContext`` built from what the
replicas reported (``METRICS``, one report per ``RECORD_S``, pushed every ``metrics_interval_s``):
``aggregated_metrics`` (each replica's reports averaged over ``look_back_period_s``) and
``raw_metrics`` (the same reports as time series), ``total_num_requests`` (requests in the
replicas plus those the Router holds, averaged) and ``total_queued_requests`` (held at the
Router now). The policy is wrapped as Serve wraps one (``_apply_autoscaling_config``: cold
start, scaling factors, up/down delays); Serve's delay logic reads ``time.time()``, so the
simulation points it at its own clock.

A new replica serves ``start_s`` after the decision; a removed one takes no new request and
drains what it holds (Serve stops replicas that are still starting first, then the newest).
TTFT = queue wait (arrival to admission, cold starts included) + prompt / prefill tokens/s.
Replica-seconds count every replica that exists: starting, serving, idle or draining.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import ray.serve.autoscaling_policy as serve_policy
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from load_tests.autoscaling.fleet import Replica, Req, Router
from load_tests.autoscaling.names import METRICS
from load_tests.autoscaling.traces import Trace

DEP = DeploymentID(name="Worker", app_name="sim")
RECORD_S = 1.0  # a replica records its metrics once a second (Serve records every 0.5 s)


@contextmanager
def serve_clock(now: Callable[[], float]) -> Iterator[None]:
    """Serve's delay logic reads ``time.time()``: it reads ``now()`` inside the block, and the
    real clock again after it (a clock left patched froze the delays of every later test)."""
    saved = serve_policy.time
    serve_policy.time = SimpleNamespace(time=now, monotonic=time.monotonic)
    try:
        yield
    finally:
        serve_policy.time = saved


class Sim:
    """``Sim(policy, cfg, hw, run).run(trace) -> summary``.

    ``hw``: the replica (``max_num_seqs, kv_tokens, step_base_s, step_per_seq_s``); ``run``:
    ``tick_s, control_period_s, start_s, prefill_tokens_per_s, ttft_slo_s, duration_s``;
    ``router``: a ``fleet.Router`` (standby and its fullness bounds), a plain one by default.
    """

    def __init__(self, policy, cfg: AutoscalingConfig, hw: SimpleNamespace,
                 run: SimpleNamespace, router: Router | None = None) -> None:
        self.policy = _apply_autoscaling_config(policy)  # what Serve's controller calls
        self.cfg, self.hw, self.run_cfg = cfg, hw, run
        self.router = router or Router()
        self.now, self.state = 0.0, {}
        self.replicas: list[Replica] = []
        self.target = cfg.initial_replicas if cfg.initial_replicas is not None else \
            cfg.min_replicas
        self.replica_s, self.next_id = 0.0, 0
        self.series: list[tuple[float, int, int]] = []  # (t, replicas, requests waiting)
        self.targets: list[tuple[float, int]] = []      # (t, target) at each control tick
        self.requests: list[Req] = []
        self._cache: tuple = (None, None)

    def run(self, trace: Trace) -> dict:
        with serve_clock(lambda: self.now):
            return self._run(trace)

    def _run(self, trace: Trace) -> dict:
        run, dt = self.run_cfg, self.run_cfg.tick_s
        pending = deque(trace)
        self._reconcile()
        for r in self.replicas:
            r.ready_at = 0.0  # the initial replicas are up at the start
        keep_s = self.cfg.look_back_period_s + self.cfg.metrics_interval_s + 1
        next_record = next_control = next_point = 0.0
        steps = 0
        while self.now < run.duration_s or self.router.queue or any(
                r.load() for r in self.replicas):
            while pending and pending[0][0] <= self.now:
                req = Req(*pending.popleft())
                self.requests.append(req)
                self.router.accept(req)
            ready = self._ready()
            self.router.route(ready)
            self.router.report(self.now)
            for r in self.replicas:
                if r.ready_at <= self.now:
                    r.admit(self.now)
                    r.step(dt)
            if any(r.stopping and not r.load() for r in self.replicas):
                self.replicas = [r for r in self.replicas if not r.stopping or r.load()]
            if self.now >= next_record:
                for r in ready:
                    r.record(self.now, self.router.demand, keep_s)
                next_record += RECORD_S
            if self.now >= next_control:
                self._control()
                next_control += run.control_period_s
            if self.now >= next_point:
                self.series.append((self.now, len(self.replicas), self._queue()))
                next_point += 1.0
            self.replica_s += dt * len(self.replicas)
            steps += 1
            self.now = steps * dt  # no drift from adding dt
        return summary(self.requests, self.replica_s, self.series, run)

    def _ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at <= self.now and not r.stopping]

    def _queue(self) -> int:
        return len(self.router.queue) + sum(len(r.waiting) for r in self.replicas)

    def context(self) -> AutoscalingContext:
        """What Serve's controller would hand the policy now."""
        cfg = self.cfg
        ready = self._ready()
        metrics, raw, ongoing = self._reports(ready)
        queued = float(len(self.router.queue))
        return AutoscalingContext(
            deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
            current_num_replicas=len(ready), target_num_replicas=self.target,
            running_replicas=[r.rid for r in ready], total_num_requests=ongoing + queued,
            total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics=raw,
            capacity_adjusted_min_replicas=cfg.min_replicas,
            capacity_adjusted_max_replicas=cfg.max_replicas, policy_state=self.state,
            last_scale_up_time=None, last_scale_down_time=None, current_time=self.now,
            config=cfg)

    def _reports(self, ready: list[Replica]) -> tuple[dict, dict, float]:
        """The replicas' reports as of the last push: look-back averages, time series, and
        the requests they hold (averaged). Cached until the next push or a change of replicas:
        nothing the controller sees changes in between."""
        cfg = self.cfg
        pushed = math.floor(self.now / cfg.metrics_interval_s) * cfg.metrics_interval_s
        key = (pushed, tuple(r.index for r in ready))
        if self._cache[0] == key:
            return self._cache[1]
        lo = pushed - cfg.look_back_period_s
        metrics: dict[str, dict] = {k: {} for k in METRICS}
        raw: dict[str, dict] = {k: {} for k in METRICS}
        ongoing = 0.0
        for r in ready:
            seen = [s for s in r.samples if lo <= s[0] <= pushed]
            if not seen:
                continue
            for i, name in enumerate(METRICS, start=1):
                metrics[name][r.rid] = sum(s[i] for s in seen) / len(seen)
                raw[name][r.rid] = [TimeStampedValue(s[0], s[i]) for s in seen]
            ongoing += metrics[METRICS[0]][r.rid] + metrics[METRICS[1]][r.rid]
        self._cache = (key, (metrics, raw, ongoing))
        return metrics, raw, ongoing

    def _control(self) -> None:
        decision, self.state = self.policy(self.context())
        self.target = min(max(math.ceil(decision), self.cfg.min_replicas), self.cfg.max_replicas)
        self.targets.append((self.now, self.target))
        self._reconcile()

    def _reconcile(self) -> None:
        live = [r for r in self.replicas if not r.stopping]
        for _ in range(self.target - len(live)):
            self.next_id += 1
            rid = ReplicaID(unique_id=f"r{self.next_id}", deployment_id=DEP)
            self.replicas.append(Replica(rid, self.next_id, self.now + self.run_cfg.start_s,
                                         self.hw))
        # Serve stops replicas that are not running yet first, then the newest
        victims = sorted(live, key=lambda r: (r.ready_at <= self.now, -r.ready_at))
        for r in victims[: max(0, len(live) - self.target)]:
            r.stopping = True  # no new requests; it drains what it holds


def ttft_s(req: Req, prefill_tokens_per_s: float) -> float:
    """Queue wait (arrival to admission) + prefill of the prompt."""
    return (req.start - req.arrival) + req.prompt / prefill_tokens_per_s


def summary(requests: list[Req], replica_s: float, series: list, run: SimpleNamespace) -> dict:
    """Replica-seconds, p50/p95/p99 TTFT, SLO attainment, peak replicas, requests."""
    ttfts = sorted(ttft_s(r, run.prefill_tokens_per_s) for r in requests)
    met = sum(1 for t in ttfts if t <= run.ttft_slo_s)
    return {"replica_s": round(replica_s, 1), "requests": len(ttfts),
            "p50_ttft_s": round(pct(ttfts, 50), 3), "p95_ttft_s": round(pct(ttfts, 95), 3),
            "p99_ttft_s": round(pct(ttfts, 99), 3),
            "slo_attainment": round(met / len(ttfts), 4) if ttfts else float("nan"),
            "peak_replicas": max((n for _, n, _ in series), default=0)}


def pct(xs: list[float], p: float) -> float:
    """The ``p``-th percentile of sorted ``xs``, nearest rank above (index ``int(n*p/100)``)."""
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")
