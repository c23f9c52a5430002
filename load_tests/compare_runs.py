"""Compare serving benchmark runs by server: a summary JSON line and, optionally, a plot.

Reads the JSON lines of ``serving_benchmark.py`` (what ``serve_vs_vllm.sh`` prints; labels like
``"pagedserve round 3"``, other lines skipped) from files or standard input. The summary holds
each server's medians and, for pagedserve against vLLM, the medians of the per-round ratios;
``--plot`` draws each run's output tokens/s and p50 TTFT by server. A run that had failed
requests (its ``failed`` count above 0, or no count at all) is named on stderr with its count
and reasons, and makes the script exit 1 after printing the summary: its figures are not
comparable.

    load_tests/serve_vs_vllm.sh "" 256 64 | tee runs.jsonl
    .venv/bin/python load_tests/compare_runs.py runs.jsonl --plot

``--plot`` without a path redraws ``docs/perf/serve_vs_vllm.png`` (shown in
``docs/perf/cpu_classes.md``); keep the runs beside it in ``docs/perf/results/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from perf_home import plot_path

KEYS = ("output_throughput", "ttft_ms_p50", "ttft_ms_p50_steady", "tpot_ms_p50")


def load_runs(lines) -> dict[str, list[dict]]:
    """Runs grouped by server name (the label before " round N"), in order."""
    by: dict[str, list[dict]] = {}
    for line in lines:
        line = line.strip()
        if not line.startswith('{"label"'):
            continue
        run = json.loads(line)
        label = run["label"]
        by.setdefault(label.rpartition(" round ")[0] or label, []).append(run)
    return by


def failures(by: dict[str, list[dict]]) -> list[str]:
    """One line per run that had failed requests (or does not say how many)."""
    out = []
    for runs in by.values():
        for run in runs:
            failed = run.get("failed")
            if failed is None:
                out.append(f"run {run['label']!r} does not say how many requests failed")
            elif failed:
                out.append(f"run {run['label']!r} had {failed} failed requests "
                           f"{run.get('failed_by_reason', run.get('failed_by_status', {}))}")
    return out


def summarize(by: dict[str, list[dict]], ours: str = "pagedserve", peer: str = "vllm") -> dict:
    """Each server's medians; ``ratio_<key>``: median over rounds run by both of ours / peer."""
    out: dict = {"summary": True, "rounds": len(by.get(ours, []))}
    for name, runs in by.items():
        out[name] = {k: statistics.median(r[k] for r in runs) for k in KEYS if k in runs[0]}
    rounds = {name: {_round(r): r for r in by.get(name, [])} for name in (ours, peer)}
    paired = sorted(set(rounds[ours]) & set(rounds[peer]))
    for k in KEYS:
        if paired and k in rounds[ours][paired[0]]:
            out[f"ratio_{k}"] = statistics.median(rounds[ours][i][k] / rounds[peer][i][k]
                                                  for i in paired)
    return out


def _round(run: dict) -> int:
    tail = run["label"].rpartition(" round ")[2]
    return int(tail) if tail.isdigit() else 0


def plot(by: dict[str, list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [("output_throughput", "output tokens/s (higher is better)"),
               ("ttft_ms_p50", "p50 time to first token, ms (lower is better)")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(10, 4))
    names = list(by)
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for i, name in enumerate(names):
            values = [r[key] for r in by[name]]
            ax.scatter([i] * len(values), values, alpha=0.6, s=28)
            median = statistics.median(values)
            ax.hlines(median, i - 0.3, i + 0.3, colors="black")
            ax.annotate(f"{median:.0f}", (i + 0.32, median), va="center", fontsize=8)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.2)
        ax.set_ylim(bottom=0)
        ax.set_title(label, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="JSON-lines files (default: standard input)")
    p.add_argument("--plot", type=Path, nargs="?", const=Path(plot_path("serve_vs_vllm.png")),
                   help="draw the runs into this PNG (no path: docs/perf/serve_vs_vllm.png)")
    p.add_argument("--title", default="Each dot one run (same load); bar: median")
    p.add_argument("--ours", default="pagedserve", help="the server whose ratios are reported")
    p.add_argument("--peer", default="vllm", help="the server it is divided by")
    args = p.parse_args(argv)
    lines = [line for f in args.files for line in Path(f).read_text().splitlines()] \
        if args.files else sys.stdin.read().splitlines()
    by = load_runs(lines)
    if not by:
        raise SystemExit("no benchmark runs in the input")
    if args.plot is not None:
        plot(by, args.plot, args.title)
    print(json.dumps(summarize(by, args.ours, args.peer)), flush=True)
    bad = failures(by)
    for line in bad:
        print(f"compare_runs: {line}", file=sys.stderr)
    if bad:
        raise SystemExit(f"compare_runs: {len(bad)} of {sum(map(len, by.values()))} runs had "
                         "failures; their figures are not comparable")


if __name__ == "__main__":
    main()
