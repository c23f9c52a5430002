"""The comparison: every (policy, trace, seed, start time) run in a process pool, one JSON line
each, the cheapest fixed count found by bisection, then the table and the plot.

    python load_tests/autoscaling_sim.py                      # the full comparison
    python load_tests/autoscaling_sim.py --quick              # one seed, one start, 10 minutes
    python load_tests/autoscaling_sim.py --trace csv:my.csv --startup-s 20 --seeds 0

``--out`` and ``--plot`` without a path write into the benchmark's home: the JSON lines to a new
``docs/perf/results/autoscaling_sim_<time>.jsonl``, the plot to ``docs/perf/autoscaling.png``
(the plot of ``docs/perf/autoscaling.md``).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import multiprocessing
import os
import sys
import time
from types import SimpleNamespace

from load_tests.autoscaling import report
from load_tests.autoscaling.policies import BASELINES, build, labels, policy_spec
from load_tests.autoscaling.sim import Sim
from load_tests.autoscaling.traces import TRACES, make_trace
from load_tests.perf_home import plot_path, results_path

# Prefill of the modelled replica, tokens/s. The replica (20 ms decode steps at batch 1, 64
# slots, 48k KV tokens) is an ~8B model on one data-centre GPU. Prefill is compute-bound at about
# 2 x parameters FLOP per token (16 GFLOP for 8B); at ~130 TFLOP/s achieved (40% of an A100's
# 312 bf16 peak) that is ~8,000 tokens/s: a 600-token prompt takes 75 ms.
PREFILL_TOKENS_PER_S = 8000.0


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Autoscaling comparison (simulated fleet).")
    p.add_argument("--trace", nargs="+", default=list(TRACES),
                   help=f"{', '.join(TRACES)} or csv:<path> (arrival_s,prompt_tokens,output_tokens)")
    p.add_argument("--duration-s", type=float, default=1800.0, help="simulated seconds per trace")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--startup-s", type=float, nargs="+", default=[10.0, 30.0],
                   help="replica start times to run (decision to serving)")
    p.add_argument("--policy", default="latency_first", help="bundled name or policy file")
    p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                   help="override policy-file fields (bounds apply to every policy)")
    p.add_argument("--default-targets", type=float, nargs="*", default=[2.0, 16.0, 64.0])
    p.add_argument("--baselines", nargs="*", default=list(BASELINES) + ["fixed"])
    p.add_argument("--prefill-tokens-per-s", type=float, default=PREFILL_TOKENS_PER_S)
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-tokens", type=int, default=48_000, help="KV-cache tokens per replica")
    p.add_argument("--step-base-s", type=float, default=0.02)
    p.add_argument("--step-per-seq-s", type=float, default=0.0006)
    p.add_argument("--tick-s", type=float, default=0.1)
    p.add_argument("--control-period-s", type=float, default=0.5)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", nargs="?", const=results_path("autoscaling_sim"),
                   help="also write the JSON lines to this file (no path: a new file in "
                   "docs/perf/results/)")
    p.add_argument("--plot", nargs="?", const=plot_path("autoscaling.png"),
                   help="replica-seconds against p95 TTFT, a PNG (no path: "
                   "docs/perf/autoscaling.png)")
    p.add_argument("--quick", action="store_true",
                   help="600 s, seed 0, start 30 s (for tests and a first look)")
    args = p.parse_args(argv)
    if args.quick:  # what was not given explicitly
        given = set(argv or sys.argv[1:])
        if "--duration-s" not in given:
            args.duration_s = 600.0
        if "--seeds" not in given:
            args.seeds = [0]
        if "--startup-s" not in given:
            args.startup_s = [30.0]
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    t0 = time.monotonic()
    opts = vars(args).copy()
    jobs = [(label, trace, seed, (start,), opts) for trace in args.trace for seed in args.seeds
            for start in args.startup_s
            for label in labels(args.default_targets, [b for b in args.baselines if b != "fixed"])]
    if "fixed" in args.baselines:  # a fixed count does not depend on the start time
        jobs += [("fixed", trace, seed, tuple(args.startup_s), opts)
                 for trace in args.trace for seed in args.seeds]
    out = open(args.out, "w") if args.out else None
    lines: list[dict] = []
    with multiprocessing.get_context("fork").Pool(max(1, args.jobs)) as pool:
        for batch in pool.imap_unordered(run_job, jobs):
            for line in batch:
                text = json.dumps(line)
                print(text, flush=True)
                if out:
                    out.write(text + "\n")
                lines.append(line)
    if out:
        out.close()
    print(report.table(lines), file=sys.stderr)
    print(f"{len(lines)} runs in {time.monotonic() - t0:.0f} s on {args.jobs} processes",
          file=sys.stderr)
    if args.plot:
        report.plot(lines, args.plot)
    return lines


def run_job(job: tuple) -> list[dict]:
    label, trace_name, seed, starts, opts = job
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # the policies' decision lines
    args = SimpleNamespace(**opts)
    trace = _trace(trace_name, args.duration_s, seed)
    if trace_name.startswith("csv:"):  # a replay lasts until its last arrival
        args.duration_s = trace[-1][0]
    if label == "fixed":
        n, result = cheapest_fixed(args, trace_name, trace, starts[0])
        return [{**_key("fixed", trace_name, seed, s), "replicas": n, **result} for s in starts]
    start = starts[0]
    return [{**_key(label, trace_name, seed, start), **simulate(label, args, trace, start)}]


def simulate(label: str, args: SimpleNamespace, trace: list, start_s: float) -> dict:
    overrides = dict(kv.split("=", 1) for kv in args.set)
    spec = policy_spec(args.policy, overrides, start_s)
    hw = SimpleNamespace(max_num_seqs=args.max_num_seqs, kv_tokens=args.kv_tokens,
                         step_base_s=args.step_base_s, step_per_seq_s=args.step_per_seq_s)
    run = SimpleNamespace(tick_s=args.tick_s, control_period_s=args.control_period_s,
                          start_s=start_s, prefill_tokens_per_s=args.prefill_tokens_per_s,
                          ttft_slo_s=args.ttft_slo_s, duration_s=args.duration_s)
    policy, cfg, router = build(label, spec, hw, trace, start_s)
    return Sim(policy, cfg, hw, run, router).run(trace)


def cheapest_fixed(args: SimpleNamespace, name: str, trace: list,
                   start_s: float) -> tuple[int, dict]:
    """The fewest replicas, never scaled, whose p95 TTFT meets the SLO (bisection over
    1..max_replicas; p95 falls as replicas are added); max_replicas when none does."""
    hi = policy_spec(args.policy, dict(kv.split("=", 1) for kv in args.set), start_s).max_replicas
    runs: dict[int, dict] = {}

    def meets(n: int) -> bool:
        runs[n] = simulate(f"fixed_{n}", args, trace, start_s)
        return runs[n]["p95_ttft_s"] <= args.ttft_slo_s

    if not meets(hi):
        return hi, {**runs[hi], "meets_slo": False}
    lo = 0  # invariant: lo fails (0 serves nothing), hi meets
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return hi, {**runs[hi], "meets_slo": True}


def _key(label: str, trace: str, seed: int, start_s: float) -> dict:
    return {"policy": label, "trace": trace, "seed": seed, "start_s": start_s}


@functools.lru_cache(maxsize=8)
def _trace(name: str, duration_s: float, seed: int) -> list:
    return make_trace(name, duration_s, seed)
