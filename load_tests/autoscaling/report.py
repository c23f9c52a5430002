"""The comparison's outputs: a markdown table of means over seeds, and the cost/latency plot."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

FIELDS = ("replica_s", "p50_ttft_s", "p95_ttft_s", "p99_ttft_s", "slo_attainment")


def means(lines: list[dict]) -> dict[tuple, dict]:
    """``(start_s, trace, policy) -> {field: mean over seeds, "seeds": n}``; the fixed counts
    are kept under "fixed" with their replica counts listed."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for line in lines:
        groups[(line["start_s"], line["trace"], line["policy"])].append(line)
    out = {}
    for key, rows in groups.items():
        out[key] = {f: float(np.mean([r[f] for r in rows])) for f in FIELDS}
        out[key]["seeds"] = len(rows)
        if "replicas" in rows[0]:
            out[key]["replicas"] = sorted(r["replicas"] for r in rows)
    return out


def table(lines: list[dict]) -> str:
    """Markdown: one row per (start time, policy), per trace "replica-s / p95 TTFT / SLO %"."""
    m = means(lines)
    traces = sorted({k[1] for k in m}, key=lambda t: (t != "bursty", t != "diurnal", t))
    order = _policy_order({k[2] for k in m})
    head = "| start s | policy | " + " | ".join(
        f"{t}: replica-s, p95 TTFT s, SLO" for t in traces) + " |"
    rows = [head, "|" + "---|" * (2 + len(traces))]
    for start in sorted({k[0] for k in m}):
        for policy in order:
            cells = []
            for t in traces:
                v = m.get((start, t, policy))
                if v is None:
                    cells.append("-")
                    continue
                cell = (f"{v['replica_s']:,.0f}, {v['p95_ttft_s']:.2f}, "
                        f"{100 * v['slo_attainment']:.1f}%")
                if "replicas" in v:
                    cell += f" (n={'/'.join(map(str, v['replicas']))})"
                cells.append(cell)
            rows.append(f"| {start:g} | {policy} | " + " | ".join(cells) + " |")
    seeds = max((v["seeds"] for v in m.values()), default=0)
    return "\n".join(rows) + f"\n\nMeans over {seeds} seed(s); SLO = share of requests within " \
        "the TTFT SLO."


def _policy_order(policies: set[str]) -> list[str]:
    first = ["queue_depth"]
    last = ["fixed", "oracle"]
    middle = sorted(p for p in policies if p not in first + last)
    return [p for p in first if p in policies] + middle + [p for p in last if p in policies]


def plot(lines: list[dict], path: str) -> None:
    """Replica-seconds (x) against p95 TTFT (y, log), one point per policy (mean over seeds),
    one panel per trace, a row per start time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = means(lines)
    starts = sorted({k[0] for k in m})
    traces = sorted({k[1] for k in m}, key=lambda t: (t != "bursty", t != "diurnal", t))
    fig, axes = plt.subplots(len(starts), len(traces), squeeze=False,
                             figsize=(5.2 * len(traces), 4.2 * len(starts)))
    policies = _policy_order({k[2] for k in m})
    markers = "o^svD<>pP*Xh"
    for row, start in zip(axes, starts):
        for ax, trace in zip(row, traces):
            for i, policy in enumerate(policies):
                v = m.get((start, trace, policy))
                if v is None:
                    continue
                ax.scatter(v["replica_s"], max(v["p95_ttft_s"], 1e-3), label=policy,
                           marker=markers[i % len(markers)], s=60 if policy != "queue_depth"
                           else 120, zorder=3 if policy == "queue_depth" else 2)
            ax.set(title=f"{trace}, start {start:g} s", xlabel="replica-seconds",
                   ylabel="p95 TTFT (s)", yscale="log")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
