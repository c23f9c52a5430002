"""One table (and a plot) of offline throughput by CPU class, dtype and model, both engines.

Reads the JSON lines ``offline_throughput.py`` prints (files or standard input; every line
says its backend, model, dtype and CPU class, capped or not), groups the runs by (model, class,
dtype), and prints a Markdown table of each backend's median output tokens/s and the ratio
of the medians, pagedserve / vLLM; ``--plot`` draws the ratios as bars.

    for isa in avx2 avx512; do
      .venv/bin/python load_tests/offline_throughput.py --backends engine,vllm \\
        --vllm-python /tmp/vllm-venv/bin/python --isa $isa --rounds 2; done | tee runs.jsonl
    .venv/bin/python load_tests/class_table.py runs.jsonl --plot

``--plot`` without a path redraws ``docs/perf/cpu_classes_latest.png``, the plot of
``docs/perf/cpu_classes.md``; keep the runs beside it in ``docs/perf/results/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from perf_home import plot_path

Key = tuple[str, str, str]  # model, CPU class, dtype


def load(lines: Iterable[str]) -> dict[Key, dict[str, list[float]]]:
    """Output tokens/s by (model, class, dtype) and backend, in file order."""
    runs: dict[Key, dict[str, list[float]]] = {}
    for line in lines:
        line = line.strip()
        if not line.startswith('{"backend"'):
            continue
        run = json.loads(line)
        cpu = run.get("cpu", {})
        key = (run["model"], cpu.get("class", "?"), run.get("dtype", "?"))
        runs.setdefault(key, {}).setdefault(run["backend"], []).append(run["output_tok_s"])
    return runs


def rows(runs: dict[Key, dict[str, list[float]]]) -> list[dict[str, object]]:
    out = []
    for (model, isa, dtype), by in sorted(runs.items()):
        ours, peer = by.get("engine"), by.get("vllm")
        row: dict[str, object] = {"model": model, "class": isa, "dtype": dtype,
                                  "runs": max(len(v) for v in by.values())}
        row["pagedserve"] = round(statistics.median(ours), 1) if ours else None
        row["vllm"] = round(statistics.median(peer), 1) if peer else None
        row["ratio"] = (round(statistics.median(ours) / statistics.median(peer), 2)
                        if ours and peer else None)
        out.append(row)
    return out


def markdown(table: list[dict[str, object]]) -> str:
    lines = ["| model | CPU class | dtype | pagedserve out tok/s | vLLM CPU out tok/s | ratio | runs |",
             "|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['class']} | {r['dtype']} | {r['pagedserve']} | "
                     f"{r['vllm']} | {r['ratio']}x | {r['runs']} |")
    return "\n".join(lines)


def plot(table: list[dict[str, object]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in table if r["ratio"] is not None]
    labels = [f"{r['model']}\n{r['class']}\n{r['dtype']}" for r in shown]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(shown)), 4))
    ax.bar(range(len(shown)), [float(r["ratio"]) for r in shown],  # type: ignore[arg-type]
           color="tab:blue")
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(shown)), labels, fontsize=8)
    ax.set_ylabel("pagedserve / vLLM CPU, output tokens/s")
    ax.set_title("Offline throughput by CPU class (median of rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="JSON-lines files (default: standard input)")
    p.add_argument("--plot", nargs="?", const=plot_path("cpu_classes_latest.png"),
                   help="write a bar chart of the ratios here (PNG; no path: the page's plot, "
                   "docs/perf/cpu_classes_latest.png)")
    args = p.parse_args()
    lines: list[str] = []
    for f in args.files or ["-"]:
        lines.extend(sys.stdin if f == "-" else Path(f).read_text().splitlines())
    table = rows(load(lines))
    print(markdown(table))
    print(json.dumps({"class_table": table}))
    if args.plot:
        plot(table, args.plot)


if __name__ == "__main__":
    main()
