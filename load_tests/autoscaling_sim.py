"""Autoscaling simulation: one arrival trace, two policies, the same modelled Worker replicas.

    python load_tests/autoscaling_sim.py --trace bursty diurnal --plot out.png

Replays an arrival trace (``bursty``: a base rate with short bursts; ``diurnal``: a day
compressed into ``--duration-s``) through

* ``QueueDepthPolicy`` with a policy file (``--policy``, default ``latency_first``), and
* Ray Serve's default policy (``replica_queue_length_autoscaling_policy``: ongoing requests /
  ``target_ongoing_requests``), once per ``--default-targets`` value,

both wrapped exactly as Serve's controller wraps a policy (``_apply_autoscaling_config``: delays,
scaling factors, cold start from zero) and given the same ``min/max_replicas``, delays and
metric windows. Every ``--control-period-s`` the policy sees a real ``AutoscalingContext``: each
replica's metrics averaged over ``look_back_period_s`` as pushed every ``metrics_interval_s``.
Serve's delay logic reads ``time.time()``; the simulation points it at its own clock.

A replica (a model on one GPU, ``--step-*``, ``--kv-tokens``, ``--max-num-seqs``): a request is
admitted when a sequence slot and KV room for prompt + output are free; every running request
gains one token per engine step of ``step_base_s + step_per_seq_s * running`` seconds. A new
replica serves after ``--startup-s``; a removed one takes no new request and finishes (drains)
the ones it holds. Requests go to the least loaded ready replica, else wait at the Router (handle
queue). The default policy is credited with one ongoing call per request; in pagedserve one
call carries a whole batch, so it would see fewer.

Prints one JSON line per trace: replica-seconds (starting and draining replicas count) and
p50/p95 queue time (arrival to admission, cold starts included) per policy.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import ray.serve.autoscaling_policy as serve_policy  # noqa: E402
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue  # noqa: E402
from ray.serve.autoscaling_policy import (  # noqa: E402
    _apply_autoscaling_config,
    replica_queue_length_autoscaling_policy,
)
from ray.serve.config import AutoscalingConfig, AutoscalingContext  # noqa: E402

from serve_app.autoscaling import QueueDepthPolicy  # noqa: E402
from serve_app.autoscaling_config import load_policy  # noqa: E402

DEP = DeploymentID(name="Worker", app_name="sim")
# Requests/s at a burst or at mid-day: about 2.5 of the modelled replicas' worth, so the
# bundled policies' max_replicas leave headroom.
PEAK_RATE = 9.0
# What Worker.record_autoscaling_stats() reports, in this order in a replica's samples.
METRICS = ("num_waiting", "num_running", "kv_cache_usage", "seq_slot_usage",
           "output_tokens_per_s")


# ---- arrivals ------------------------------------------------------------------------------

def rate_fn(trace: str, duration: float, seed: int):
    """Requests/s at time t for a trace."""
    if trace == "diurnal":  # night at the ends, peak at mid-day
        return lambda t: 0.3 + (PEAK_RATE - 0.3) * (1 - math.cos(2 * math.pi * t / duration)) / 2
    rng = random.Random(seed)
    bursts = [(s, s + rng.uniform(30, 90)) for s in sorted(rng.uniform(0, duration - 90)
                                                            for _ in range(int(duration / 300)))]
    return lambda t: PEAK_RATE if any(a <= t < b for a, b in bursts) else 1.5


def arrivals(rate, duration: float, seed: int, peak: float = PEAK_RATE) -> list[tuple]:
    """(time, prompt tokens, output tokens), non-homogeneous Poisson by thinning."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() < rate(t) / peak:
            prompt = int(min(4000, max(16, rng.lognormvariate(math.log(600), 0.8))))
            output = int(min(1500, max(8, rng.lognormvariate(math.log(200), 0.7))))
            out.append((t, prompt, output))


# ---- the modelled replica ------------------------------------------------------------------

@dataclass(eq=False)
class Req:
    arrival: float
    prompt: int
    output: int
    left: float = 0.0
    start: float | None = None


@dataclass(eq=False)
class Replica:
    rid: ReplicaID
    ready_at: float
    hw: SimpleNamespace
    stopping: bool = False
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    kv_used: int = 0
    samples: deque = field(default_factory=deque)  # (t, *the METRICS values)
    tokens: float = 0.0  # generated since the last sample

    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def admit(self, now: float) -> None:
        hw = self.hw
        while self.waiting and len(self.running) < hw.max_num_seqs:
            r = self.waiting[0]
            if self.kv_used + r.prompt + r.output > hw.kv_tokens and self.running:
                return
            self.waiting.popleft()
            r.start, r.left = now, float(r.output)
            self.kv_used += r.prompt + r.output
            self.running.append(r)

    def step(self, dt: float) -> None:
        if not self.running:
            return
        per_req = dt / (self.hw.step_base_s + self.hw.step_per_seq_s * len(self.running))
        self.tokens += per_req * len(self.running)
        still = []
        for r in self.running:
            r.left -= per_req
            if r.left > 0:
                still.append(r)
            else:
                self.kv_used -= r.prompt + r.output
        self.running = still

    def sample(self, now: float, since: float, keep_s: float) -> None:
        kv, slots = self.kv_used / self.hw.kv_tokens, len(self.running) / self.hw.max_num_seqs
        self.samples.append((now, len(self.waiting), len(self.running), kv, slots,
                             self.tokens / since))
        self.tokens = 0.0
        while self.samples and self.samples[0][0] < now - keep_s:
            self.samples.popleft()


# ---- the run -------------------------------------------------------------------------------

class Sim:
    def __init__(self, policy, cfg: AutoscalingConfig, hw: SimpleNamespace, args) -> None:
        self.policy = _apply_autoscaling_config(policy)  # what Serve's controller calls
        self.cfg, self.hw, self.args = cfg, hw, args
        self.now, self.state, self.handle_queue = 0.0, {}, deque()
        self.replicas: list[Replica] = []
        self.target = cfg.initial_replicas if cfg.initial_replicas is not None else \
            cfg.min_replicas
        self.replica_s, self.next_id, self.series = 0.0, 0, []
        self.requests: list[Req] = []

    def run(self, trace: list[tuple]) -> dict:
        # Serve's delay logic reads time.time(): give it the simulated clock
        serve_policy.time = SimpleNamespace(time=lambda: self.now, monotonic=time.monotonic)
        a, dt, pending = self.args, self.args.tick_s, deque(trace)
        self._reconcile()
        for r in self.replicas:
            r.ready_at = 0.0  # the initial replicas are up at the start
        record_every = min(self.cfg.look_back_period_s * 0.2, self.cfg.metrics_interval_s)
        next_sample = next_control = next_point = 0.0
        while self.now < a.duration_s or self.handle_queue or any(r.load() for r in self.replicas):
            while pending and pending[0][0] <= self.now:
                self.requests.append(Req(*pending.popleft()))
                self.handle_queue.append(self.requests[-1])
            self._route()
            for r in self.replicas:
                if r.ready_at <= self.now:
                    r.admit(self.now)
                    r.step(dt)
            self._drop_drained()
            if self.now >= next_sample:
                for r in self._ready():
                    r.sample(self.now, record_every, self.cfg.look_back_period_s + 1)
                next_sample += record_every
            if self.now >= next_control:
                self._control()
                next_control += a.control_period_s
            if self.now >= next_point:
                self.series.append((self.now, len(self.replicas), self._queue()))
                next_point += 1.0
            self.replica_s += dt * len(self.replicas)
            self.now += dt
        return self._summary()

    def _ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at <= self.now and not r.stopping]

    def _queue(self) -> int:
        return len(self.handle_queue) + sum(len(r.waiting) for r in self.replicas)

    def _route(self) -> None:
        ready = self._ready()
        while self.handle_queue and ready:
            min(ready, key=Replica.load).waiting.append(self.handle_queue.popleft())

    def _drop_drained(self) -> None:
        for r in [r for r in self.replicas if r.stopping and not r.load()]:
            self.replicas.remove(r)

    def _context(self) -> AutoscalingContext:
        pushed = math.floor(self.now / self.cfg.metrics_interval_s) * self.cfg.metrics_interval_s
        window = (pushed - self.cfg.look_back_period_s, pushed)
        ready = self._ready()
        metrics: dict[str, dict] = {k: {} for k in METRICS}
        raw: dict[str, dict] = {k: {} for k in METRICS}
        ongoing = 0.0
        for r in ready:
            seen = [s for s in r.samples if window[0] <= s[0] <= window[1]]
            if not seen:
                continue
            for i, name in enumerate(METRICS, start=1):
                metrics[name][r.rid] = sum(s[i] for s in seen) / len(seen)
                raw[name][r.rid] = [TimeStampedValue(s[0], s[i]) for s in seen]
            ongoing += metrics["num_waiting"][r.rid] + metrics["num_running"][r.rid]
        queued = float(len(self.handle_queue))
        return AutoscalingContext(
            deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
            current_num_replicas=len(ready), target_num_replicas=self.target,
            running_replicas=[r.rid for r in ready], total_num_requests=ongoing + queued,
            total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics=raw,
            capacity_adjusted_min_replicas=self.cfg.min_replicas,
            capacity_adjusted_max_replicas=self.cfg.max_replicas, policy_state=self.state,
            last_scale_up_time=None, last_scale_down_time=None, current_time=self.now,
            config=self.cfg)

    def _control(self) -> None:
        decision, self.state = self.policy(self._context())
        self.target = min(max(math.ceil(decision), self.cfg.min_replicas), self.cfg.max_replicas)
        self._reconcile()

    def _reconcile(self) -> None:
        live = [r for r in self.replicas if not r.stopping]
        for _ in range(self.target - len(live)):
            self.next_id += 1
            rid = ReplicaID(unique_id=f"r{self.next_id}", deployment_id=DEP)
            self.replicas.append(Replica(rid, self.now + self.args.startup_s, self.hw))
        # Serve stops replicas that are not running yet first, then the newest
        victims = sorted(live, key=lambda r: (r.ready_at <= self.now, -r.ready_at))
        for r in victims[: max(0, len(live) - self.target)]:
            r.stopping = True  # no new requests; it drains what it holds

    def _summary(self) -> dict:
        waits = sorted(r.start - r.arrival for r in self.requests)
        return {"replica_s": round(self.replica_s), "requests": len(waits),
                "p50_queue_s": round(_pct(waits, 50), 3), "p95_queue_s": round(_pct(waits, 95), 3),
                "peak_replicas": max(n for _, n, _ in self.series)}


def _pct(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * p / 100))] if xs else float("nan")


# ---- main ----------------------------------------------------------------------------------

def policies(args) -> list[tuple[str, object, AutoscalingConfig]]:
    """(label, policy callable, Serve config) for QueueDepthPolicy and each default target."""
    overrides = dict(kv.split("=", 1) for kv in args.set)
    spec = load_policy({**load_policy(args.policy).model_dump(), **overrides})  # validated
    serve_cfg = spec.serve_autoscaling_config()
    out = [("queue_depth", QueueDepthPolicy(**spec.policy_kwargs()),
            AutoscalingConfig(**serve_cfg))]
    for target in args.default_targets:
        cfg = AutoscalingConfig(**{**serve_cfg, "policy": {}, "target_ongoing_requests": target})
        out.append((f"serve_default_t{target:g}", replica_queue_length_autoscaling_policy, cfg))
    return out


def run_trace(trace: str, args, hw: SimpleNamespace) -> tuple[dict, dict]:
    rate = rate_fn(trace, args.duration_s, args.seed)
    reqs = arrivals(rate, args.duration_s, args.seed)
    line: dict = {"trace": trace, "duration_s": args.duration_s, "requests": len(reqs),
                  "policy_file": args.policy, "overrides": args.set,
                  "startup_s": args.startup_s}
    series = {}
    for label, policy, cfg in policies(args):
        sim = Sim(policy, cfg, hw, args)
        line[label] = sim.run(reqs)
        series[label] = sim.series
    return line, series


def plot(path: str, results: list[tuple[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(13, 3.6 * len(results)), squeeze=False)
    for row, (trace, series) in zip(axes, results):
        for label, points in reversed(series.items()):  # QueueDepthPolicy drawn on top
            t = [p[0] / 60 for p in points]
            lw = 2.0 if label == "queue_depth" else 1.0
            row[0].plot(t, [p[1] for p in points], label=label, lw=lw)
            row[1].plot(t, [p[2] for p in points], label=label, lw=lw)
        row[0].set(title=f"{trace}: replicas (incl. starting, draining)", xlabel="minutes",
                   ylabel="replicas")
        row[1].set(title=f"{trace}: requests waiting (Router + replicas)", xlabel="minutes",
                   ylabel="requests")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", nargs="+", default=["bursty", "diurnal"],
                   choices=["bursty", "diurnal"])
    p.add_argument("--duration-s", type=float, default=1800.0,
                   help="simulated seconds per trace (diurnal: one day compressed into it)")
    p.add_argument("--policy", default="latency_first", help="bundled name or policy file")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override policy fields, e.g. downscale_delay_s=60")
    p.add_argument("--default-targets", type=float, nargs="+", default=[16.0, 64.0],
                   help="target_ongoing_requests values for Serve's default policy")
    p.add_argument("--startup-s", type=float, default=30.0, help="new replica: time to serve")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=48_000, help="KV-cache tokens per replica")
    p.add_argument("--step-base-s", type=float, default=0.02)
    p.add_argument("--step-per-seq-s", type=float, default=0.0006)
    p.add_argument("--tick-s", type=float, default=0.1)
    p.add_argument("--control-period-s", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write replicas and queue depth over time to this PNG")
    args = p.parse_args(argv)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the policies' decision lines
    hw = SimpleNamespace(max_num_seqs=args.max_num_seqs, kv_tokens=args.kv_tokens,
                         step_base_s=args.step_base_s, step_per_seq_s=args.step_per_seq_s)
    results = []
    for trace in args.trace:
        line, series = run_trace(trace, args, hw)
        print(json.dumps(line), flush=True)
        results.append((trace, series))
    if args.plot:
        plot(args.plot, results)


if __name__ == "__main__":
    main()
