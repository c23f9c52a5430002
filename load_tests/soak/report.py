"""The soak's outcomes and report: what each request got, which invariants held, the table.

``summarize`` judges every ``Outcome`` against the fault windows: a request in flight while a
Worker or Router was killed may fail (a Worker kill with an error in OpenAI's shape, a Router
kill however Serve's proxy ends it); any other failure, and any failure while the Workers were
scaled down, breaks an invariant.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from .mix import Mix
from .spec import REQUEST_INVARIANTS, References, Spec, Verdict

KILL_FAULTS = ("worker_kill", "router_kill")


@dataclass
class Outcome:
    spec: Spec
    status: int  # 0: no HTTP answer (connection error, or hung)
    verdict: Verdict
    start: float
    end: float
    hung: bool = False
    phase: str = "main"


@dataclass
class Fault:
    name: str
    start: float
    end: float | None = None  # when the service had recovered; None: it did not
    detail: dict = field(default_factory=dict)


class Run(Protocol):
    """What the report reads of a finished run (``runner.Runner``)."""

    outcomes: list[Outcome]
    refs: References
    mix: Mix

    def now(self) -> float: ...


def workers_idle(workers: list[dict]) -> bool:
    """Every Worker in ``workers`` (``/v1/stats``) has all KV blocks free and no request."""
    return all(w["num_free_blocks"] == w["num_total_blocks"] and w["num_waiting"] == 0
               and w["num_running"] == 0 for w in workers)


def idle(stats: dict, num_workers: int | None) -> bool:
    """``workers_idle`` for ``num_workers`` Workers (None: any number but none), and the
    Router has nothing waiting or active."""
    workers = stats.get("workers", [])
    router = stats.get("router", {})
    return (bool(workers) and (num_workers is None or len(workers) == num_workers)
            and workers_idle(workers)
            and router.get("num_waiting", 0) == 0 and router.get("num_active", 0) == 0)


def summarize(runner: Run, faults: list[Fault], after_main: dict, final: dict,
              memory: list[dict[str, int]], args: argparse.Namespace) -> dict:
    """The report: counts, faults, KV and memory figures, each invariant and its violations."""
    outs = runner.outcomes
    problems: dict[str, list[str]] = {k: [] for k in REQUEST_INVARIANTS}
    for f in faults:
        problems.setdefault("scale_down" if f.name == "scale_up" else f.name, [])
    for o in outs:
        _judge_outcome(o, faults, problems)
    _judge_faults(faults, problems)
    bursts = [o for o in outs if o.spec.kind == "burst"]
    if bursts and args.burst_size > args.max_waiting and not any(o.status == 429 for o in bursts):
        problems["overload_429"].append(f"bursts of {args.burst_size} got no 429")
    for name, stats in (("after the run", after_main), ("after the memory passes", final)):
        if not idle(stats, None):
            problems.setdefault("kv_free_queues_empty", []).append(f"not idle {name}: {stats}")
    problems.setdefault("kv_free_queues_empty", [])
    if len(memory) == 2:
        problems["memory_stable"] = _memory_growth(memory, args.memory_slack_mib)
    report = _counts(runner, outs)
    report.update(
        faults=[{"name": f.name, "at_s": round(f.start, 1),
                 "recovery_s": None if f.end is None else round(f.end - f.start, 1),
                 **f.detail} for f in faults],
        kv=[{"replica": w.get("replica"), "free_blocks": w["num_free_blocks"],
             "total_blocks": w["num_total_blocks"], "waiting": w["num_waiting"],
             "running": w["num_running"]} for w in final.get("workers", [])],
        rss_mib=[{k: round(v / 2 ** 20, 1) for k, v in sorted(m.items())} for m in memory],
        invariants={k: not v for k, v in problems.items()},
        violations=[f"{k}: {t}" for k, v in problems.items() for t in v[:5]],
        reference_prompts=len(runner.refs.texts))
    return report


def _judge_outcome(o: Outcome, faults: list[Fault], problems: dict[str, list[str]]) -> None:
    """Add what ``o`` broke to ``problems``; an error while a kill was in flight is counted on
    the fault instead, and judged by ``_clear``."""
    kill = _window(o, faults, KILL_FAULTS)
    failed = o.verdict.category == "failed"
    fault_error = kill is not None and failed and (
        o.status >= 500 or o.status == 0 or o.verdict.detail in ("stream_error", "stream_cut"))
    for inv, text in o.verdict.problems:
        if not (fault_error and inv in ("bad_input_4xx", "errors_openai_shape")):
            problems[inv].append(text)
    if fault_error:
        seen = kill.detail.setdefault("in_flight_errors", {})
        label = f"{o.verdict.detail}{'' if o.verdict.error_shaped else ' (not OpenAI-shaped)'}"
        seen[label] = seen.get(label, 0) + 1
        examples = kill.detail.setdefault("examples", [])
        if len(examples) < 3 and o.verdict.sample:
            examples.append(f"{o.status} {o.verdict.sample[:100]}")
        if not _clear(o, kill):
            problems[kill.name].append(f"{o.spec.kind}: unclear error {o.verdict.detail}")
    if failed and not o.spec.bad and kill is None:
        problems["no_unexpected_failures"].append(
            f"{o.spec.kind} {o.spec.request_id} at {o.start:.1f}s: {o.verdict.detail}")
    if (failed or o.hung) and _window(o, faults, ("scale_down", "scale_up")):
        problems["scale_down"].append(f"{o.spec.kind} at {o.start:.1f}s: {o.verdict.detail}")


def _judge_faults(faults: list[Fault], problems: dict[str, list[str]]) -> None:
    """A fault the service did not recover from, or a scale step with failed probes."""
    for f in faults:
        if f.name in ("scale_down", "scale_up") and f.detail.get("failed_probes"):
            problems["scale_down"].append(f"{f.name}: probes failed: {f.detail['failed_probes']}")
        if f.end is None:
            problems["scale_down" if f.name == "scale_up" else f.name].append(
                f"{f.name} at {f.start:.1f}s did not recover: {f.detail}")


def _window(o: Outcome, faults: list[Fault], names: tuple[str, ...]) -> Fault | None:
    """The latest of ``names`` whose window ``o`` overlaps: a request that started while one
    fault was recovering and failed once the next began is the next one's."""
    for f in reversed(faults):
        if f.name in names and o.start < (f.end if f.end is not None else 1e18) \
                and o.end > f.start:
            return f
    return None


def _clear(o: Outcome, fault: Fault) -> bool:
    """A Worker kill must give an error in OpenAI's shape (JSON or an SSE error event); a
    killed Router's requests end however Serve's proxy ends them (counted, not judged)."""
    return fault.name == "router_kill" or o.verdict.error_shaped


def _memory_growth(memory: list[dict[str, int]], slack_mib: float) -> list[str]:
    first, second = memory
    out = []
    for key in sorted(first.keys() & second.keys()):
        allowed = max(slack_mib * 2 ** 20, 0.05 * first[key])
        if second[key] - first[key] > allowed:
            out.append(f"{key}: {first[key] / 2 ** 20:.1f} -> {second[key] / 2 ** 20:.1f} MiB")
    if not first.keys() & second.keys():
        out.append("no replica lived through both passes")
    return out


def _counts(runner: Run, outs: list[Outcome]) -> dict:
    by = Counter(o.verdict.category for o in outs)
    lat = sorted(o.end - o.start for o in outs
                 if o.verdict.category == "completed" and not o.spec.bad)
    kinds = Counter(o.spec.kind.split(":")[0] for o in outs)
    return {
        "duration_s": round(runner.now(), 1), "sent": len(outs),
        "completed": by["completed"], "disconnected": by["disconnected"],
        "rejected": dict(Counter(o.verdict.detail for o in outs
                                 if o.verdict.category == "rejected")),
        "failed": dict(Counter(o.verdict.detail or str(o.status) for o in outs
                               if o.verdict.category == "failed")),
        "hung": by["hung"], "kinds": dict(kinds),
        "bad_cases_sent": len({o.spec.kind for o in outs if o.spec.bad}),
        "bad_cases_defined": len(runner.mix.bad_cases),
        "latency_p50_s": _pct(lat, 0.50), "latency_p99_s": _pct(lat, 0.99),
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 3)


def table(report: dict) -> str:
    rows = [("requests sent", report["sent"]), ("completed", report["completed"]),
            ("client disconnects", report["disconnected"]),
            ("rejected", _fmt(report["rejected"])), ("failed", _fmt(report["failed"])),
            ("hung", report["hung"]),
            ("latency p50 / p99 (s)", f"{report['latency_p50_s']} / {report['latency_p99_s']}")]
    for f in report["faults"]:
        rows.append((f"fault {f['name']} at {f['at_s']}s",
                     f"recovered in {f['recovery_s']}s" if f["recovery_s"] is not None
                     else "NOT recovered"))
    for w in report["kv"]:
        rows.append((f"Worker {w['replica']} KV free/total",
                     f"{w['free_blocks']}/{w['total_blocks']} (waiting {w['waiting']}, "
                     f"running {w['running']})"))
    for k, m in enumerate(report["rss_mib"]):
        rows.append((f"RSS after memory pass {k + 1} (MiB)", _fmt(m)))
    rows += [(f"invariant {k}", "pass" if ok else "FAIL")
             for k, ok in report["invariants"].items()]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _fmt(d: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "-"
