"""The plotting helper of the serving benchmarks (load_tests/plot_serving.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "load_tests"))

import plot_serving  # noqa: E402


def _run(label: str, tok_s: float, ttft: float) -> str:
    return json.dumps({"label": label, "output_throughput": tok_s, "ttft_ms_p50": ttft})


def test_runs_group_by_server_and_skip_summaries(tmp_path):
    lines = [_run("pagedserve round 1", 3000.0, 50.0), _run("vllm round 1", 2500.0, 70.0),
             "not json", json.dumps({"summary": True, "rounds": 2}),
             _run("vllm round 2", 2600.0, 65.0), _run("pagedserve round 2", 3100.0, 45.0),
             _run("solo", 10.0, 1.0)]
    by = plot_serving.load_runs(lines)
    assert {k: [r["output_throughput"] for r in v] for k, v in by.items()} == {
        "pagedserve": [3000.0, 3100.0], "vllm": [2500.0, 2600.0], "solo": [10.0]}

    src = tmp_path / "runs.jsonl"
    src.write_text("\n".join(lines))
    out = tmp_path / "plot.png"
    plot_serving.main([str(src), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
