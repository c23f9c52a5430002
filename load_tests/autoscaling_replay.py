"""The real thing beside the simulator: a compressed bursty trace replayed against the app.

    .venv/bin/python load_tests/autoscaling_replay.py            # about 12 minutes on 2 cores

One invocation, one local Ray cluster per policy (127.0.0.1 only), the app deployed from a
config as ``serve deploy`` does (``serve_app:build_app``), Workers of one thread each, 1 to
``--max-workers`` (2: a third adds no core on a 2-core machine, only contention). The model is
the Qwen2.5-0.5B shape by default: with the tiny default model a Worker does less work per token
than the Router and the load generator, and on two cores their contention, not the policy,
decides the result.

1. **Calibrate** on the first app: one Worker's step time with 1 and with ``max_num_seqs``
   streams, its time to first token when idle (prefill), and the completions/s it sustains.
2. **Trace**: ``bursty`` compressed to ``--duration-s``: a base rate at ``--base-load`` of one
   Worker's capacity and ``--bursts`` bursts at ``--burst-load`` of it (arrivals Poisson,
   output lengths spread around ``--max-tokens``), the same for every policy.
3. **Replay** it once per policy: the project's (``latency_first``'s rule, without and with its
   standby capacity, which it keeps after a first burst) and Ray Serve's default (``policy:
   serve_default``, target 2 ongoing calls), with the same bounds, delays and windows. Every request streams; TTFT is measured at the client; a 429 or an
   error counts against the SLO. Replica-seconds: every Worker replica Serve reports, starting
   and stopping ones included, sampled each second until the last request ends. The start
   time of each scale-up (a replica STARTING to RUNNING) is recorded too.
4. **Predict** the same runs with the simulator (``load_tests/autoscaling``): the trace as CSV,
   the calibrated replica model, the measured start time.

Prints one JSON line per (policy, source) with p50/p95/p99 TTFT, SLO attainment and
replica-seconds, real and simulated side by side; ``--out`` also appends them to a file (without
a path, a new ``docs/perf/results/autoscaling_replay_<time>.jsonl``, beside the page that reports
the replay, ``docs/perf/autoscaling.md``). Every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "load_tests"))

from perf_home import results_path  # noqa: E402
from soak.cluster import APP, LocalApp, wait_for  # noqa: E402

from serve_app.autoscaling.config import load_policy  # noqa: E402

WORKER = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20,
          "num_threads": 1, "accelerator": "cpu", "worker_num_cpus": 0.1,
          "router_num_cpus": 0.1, "routing_stats_period_s": 0.5, "max_num_seqs": 4}
PROMPT = "The autoscaling replay sends this prompt with a counter, number "


def policy_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The policies, same bounds, delays and windows. The project's two: latency_first's rule
    without and with its standby Worker; Serve's default at its default target."""
    common = {"min_replicas": 1, "max_replicas": args.max_workers, "upscale_delay_s": 0.0,
              "downscale_delay_s": args.downscale_delay_s, "look_back_period_s": 10.0,
              "metrics_interval_s": 1.0, "idle_timeout_s": 60.0}
    ours = {**load_policy("latency_first").model_dump(), **common,
            "replica_start_s": args.start_s}
    every = {"queue_depth": {**ours, "standby_replicas": 0},
             "queue_depth_standby": {**ours, "standby_replicas": 1},
             "serve_default": {**common, "policy": "serve_default",
                               "target_ongoing_requests": 2}}
    return {name: every[name] for name in args.policies}


class ReplayApp(LocalApp):
    """The soak's local app, deployed with an autoscaling policy instead of a fixed count."""

    def _deploy(self, num_workers: int) -> None:
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        app = {"name": APP, "route_prefix": "/", "import_path": "serve_app:build_app",
               "args": self.args}
        config = ServeDeploySchema.model_validate({"http_options": self.http,
                                                   "applications": [app]})
        _get_global_client().deploy_apps(config, _blocking=False)


# ---- requests ------------------------------------------------------------------------------

async def stream_one(client: httpx.AsyncClient, url: str, prompt: str,
                     max_tokens: int) -> tuple[float | None, int]:
    """(seconds to the first text chunk or None, HTTP status) of one streamed completion."""
    sent = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    first = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return None, resp.status_code
            async for line in resp.aiter_lines():
                if first is None and line.startswith("data: {") and '"text":"' in \
                        line.replace(" ", "") and '"text":""' not in line.replace(" ", ""):
                    first = time.monotonic() - sent
    except httpx.HTTPError:
        return None, -1
    return first, 200


async def replay(url: str, trace: list[tuple[float, int, int]]) -> list[tuple[float | None, int]]:
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.monotonic()

        async def at(i: int, t: float, max_tokens: int) -> tuple[float | None, int]:
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            return await stream_one(client, url, f"{PROMPT}{i}", max_tokens)

        return list(await asyncio.gather(*(at(i, t, out)
                                           for i, (t, _, out) in enumerate(trace))))


def run_concurrently(url: str, streams: int, seconds: float, max_tokens: int,
                     ) -> tuple[float, list[float]]:
    """(completions/s, TTFTs) of ``streams`` clients sending back to back for ``seconds``."""
    async def client_loop(client: httpx.AsyncClient, i: int, end: float, out: list) -> None:
        n = 0
        while time.monotonic() < end:
            out.append(await stream_one(client, url, f"{PROMPT}c{i}-{n}", max_tokens))
            n += 1

    async def main() -> list:
        out: list = []
        async with httpx.AsyncClient(timeout=120) as client:
            end = time.monotonic() + seconds
            await asyncio.gather(*(client_loop(client, i, end, out) for i in range(streams)))
        return out

    began = time.monotonic()
    results = asyncio.run(main())
    done = [r for r in results if r[1] == 200]
    return len(done) / (time.monotonic() - began), [r[0] for r in done if r[0] is not None]


def wait_serving(url: str, timeout_s: float = 300.0) -> None:
    """Until a completion answers 200: Serve reports the app running a moment before the
    Router has learnt the model from a Worker (503 until then)."""
    def ok() -> bool:
        try:
            return httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 1}).status_code == 200
        except httpx.HTTPError:
            return False

    if wait_for(ok, timeout_s, 1.0) is None:
        raise RuntimeError(f"the app at {url} answered no completion within {timeout_s:.0f} s")


# ---- calibration and trace -----------------------------------------------------------------

def model_path(name: str) -> str:
    from load_tests.offline_throughput import checkpoint_path

    return str(checkpoint_path(name))


def calibrate(url: str, max_tokens: int, max_num_seqs: int) -> dict[str, float]:
    run_concurrently(url, 1, 5.0, max_tokens)  # warm
    one_rps, ttfts = run_concurrently(url, 1, 20.0, max_tokens)
    full_rps, _ = run_concurrently(url, max_num_seqs, 30.0, max_tokens)
    prefill_s = sorted(ttfts)[len(ttfts) // 2]
    step1 = (1.0 / one_rps - prefill_s) / max_tokens  # one stream: a step per token
    stepn = (max_num_seqs / full_rps - prefill_s) / max_tokens
    per_seq = max(0.0, (stepn - step1) / (max_num_seqs - 1))
    return {"capacity_rps": full_rps, "prefill_s": prefill_s,
            "step_base_s": max(1e-4, step1 - per_seq), "step_per_seq_s": per_seq}


def make_trace(args: argparse.Namespace, capacity_rps: float) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens (approximate), output tokens), Poisson by thinning."""
    rng = random.Random(args.seed)
    base, peak = args.base_load * capacity_rps, args.burst_load * capacity_rps
    span = args.duration_s / (args.bursts + 1)
    bursts = [((i + 1) * span - args.burst_s / 2, (i + 1) * span + args.burst_s / 2)
              for i in range(args.bursts)]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= args.duration_s:
            return out
        rate = peak if any(a <= t < b for a, b in bursts) else base
        if rng.random() < rate / peak:
            tokens = max(8, min(4 * args.max_tokens, int(rng.gauss(args.max_tokens,
                                                                   args.max_tokens / 4))))
            out.append((round(t, 3), 16, tokens))


# ---- one policy ----------------------------------------------------------------------------

class ReplicaMeter(threading.Thread):
    """Samples Serve's Worker replica states each second: replica-seconds and start times."""

    def __init__(self, app: ReplayApp) -> None:
        super().__init__(daemon=True)
        self.app, self.stop = app, threading.Event()
        self.replica_s, self.series, self.starts = 0.0, [], []
        self._starting_since: float | None = None

    def run(self) -> None:
        began = last = time.monotonic()
        while not self.stop.wait(1.0):
            states = self.app.replica_states("Worker")
            now = time.monotonic()
            total = sum(states.values())
            self.replica_s += total * (now - last)
            last = now
            self.series.append((round(now - began, 1), total, states.get("RUNNING", 0)))
            starting = states.get("STARTING", 0)
            if starting and self._starting_since is None:
                self._starting_since = now
            elif not starting and self._starting_since is not None:
                self.starts.append(round(now - self._starting_since, 1))
                self._starting_since = None


def run_policy(name: str, policy: dict[str, Any], args: argparse.Namespace,
               trace: list | None) -> tuple[dict[str, Any], dict[str, float] | None]:
    model = {} if args.model == "default" else {"model": model_path(args.model)}
    app = ReplayApp({**WORKER, **model, "autoscaling": policy}, num_workers=1)
    try:
        wait_serving(app.url)
        calib = None
        if trace is None:
            calib = calibrate(app.url, args.max_tokens, WORKER["max_num_seqs"])
            wait_for(lambda: app.replica_states("Worker") == {"RUNNING": 1}, 120, 1.0)
            return {"policy": name}, calib
        wait_for(lambda: app.replica_states("Worker") == {"RUNNING": policy["min_replicas"]},
                 300, 1.0)
        meter = ReplicaMeter(app)
        meter.start()
        results = asyncio.run(replay(app.url, trace))
        meter.stop.set()
        meter.join(timeout=5)
        return summarize(name, "real", results, meter.replica_s, args.slo_s) | {
            "starts_s": meter.starts, "peak_replicas": max(n for _, n, _ in meter.series)}, None
    finally:
        app.close()


def summarize(policy: str, source: str, results: list[tuple[float | None, int]],
              replica_s: float, slo_s: float) -> dict[str, Any]:
    ttfts = sorted(r[0] if r[0] is not None else math.inf for r in results)

    def pct(p: float) -> float:
        v = ttfts[min(len(ttfts) - 1, int(len(ttfts) * p / 100))]
        return round(v, 3) if math.isfinite(v) else -1.0

    return {"policy": policy, "source": source, "requests": len(results),
            "p50_ttft_s": pct(50), "p95_ttft_s": pct(95), "p99_ttft_s": pct(99),
            "slo_attainment": round(sum(t <= slo_s for t in ttfts) / max(1, len(ttfts)), 3),
            "errors": sum(r[1] != 200 for r in results), "replica_s": round(replica_s)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=240.0)
    p.add_argument("--bursts", type=int, default=2)
    p.add_argument("--burst-s", type=float, default=40.0)
    p.add_argument("--base-load", type=float, default=0.4, help="of one Worker's capacity")
    p.add_argument("--burst-load", type=float, default=1.8, help="of one Worker's capacity")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default="0.5b", choices=["0.5b", "tiny", "default"],
                   help="0.5b: the Qwen2.5-0.5B shape (offline_throughput's checkpoint)")
    p.add_argument("--max-workers", type=int, default=2,
                   help="max_replicas for every policy (2 cores hold two 1-thread Workers)")
    p.add_argument("--policies", nargs="+",
                   default=["queue_depth", "queue_depth_standby", "serve_default"])
    p.add_argument("--slo-s", type=float, default=2.0, help="TTFT SLO")
    p.add_argument("--start-s", type=float, default=15.0,
                   help="replica_start_s given to QueueDepthPolicy")
    p.add_argument("--downscale-delay-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", nargs="?", const=results_path("autoscaling_replay"), default="",
                   help="also append the JSON lines to this file (no path: a new file in "
                   "docs/perf/results/)")
    args = p.parse_args(argv)
    settings = policy_settings(args)
    one = {**next(iter(settings.values())), "standby_replicas": 0, "max_replicas": 1}
    _, calib = run_policy("calibration", one, args, None)
    trace = make_trace(args, calib["capacity_rps"])
    print(json.dumps({"calibration": calib, "requests": len(trace), **vars(args)}), flush=True)
    lines = []
    for name, policy in settings.items():
        line, _ = run_policy(name, policy, args, trace)
        lines.append(line)
        print(json.dumps(line), flush=True)
    lines += simulate(args, settings, trace, calib, lines)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)
    return 0


def simulate(args: argparse.Namespace, settings: dict[str, dict[str, Any]], trace: list,
             calib: dict[str, float], real: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The simulator's prediction of the same runs (printed as it goes)."""
    from autoscaling_predict import predict

    measured = [s for line in real for s in line.get("starts_s", [])]
    start_s = sorted(measured)[len(measured) // 2] if measured else args.start_s
    out = []
    for name, policy in settings.items():
        line = predict(name, policy, trace, calib, start_s, args.slo_s,
                       WORKER["max_num_seqs"])
        print(json.dumps(line), flush=True)
        out.append(line)
    return out


if __name__ == "__main__":
    sys.exit(main())
