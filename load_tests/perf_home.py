"""Where benchmark results live: one page per benchmark in ``docs/perf/`` with its plots beside
it, and the raw runs (JSON lines) in ``docs/perf/results/`` (``docs/perf/README.md`` lists the
pages). A script's ``--plot`` or ``--out`` given without a path writes here."""

from __future__ import annotations

import time
from pathlib import Path

PERF_DIR = Path(__file__).resolve().parents[1] / "docs" / "perf"
RESULTS_DIR = PERF_DIR / "results"


def plot_path(name: str) -> str:
    """``docs/perf/<name>``: a plot sits beside the page that shows it."""
    return str(PERF_DIR / name)


def results_path(stem: str) -> str:
    """A new runs file, ``docs/perf/results/<stem>_<YYYYMMDD_HHMMSS>.jsonl`` (local time), so
    that a run never overwrites one a page links to."""
    return str(RESULTS_DIR / f"{stem}_{time.strftime('%Y%m%d_%H%M%S')}.jsonl")
