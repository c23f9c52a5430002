"""The comparison helpers of the benchmarks (load_tests/compare_runs.py, class_table.py, runs.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "load_tests"))

import compare_runs  # noqa: E402


def _run(label: str, tok_s: float, ttft: float, failed: int = 0) -> str:
    return json.dumps({"label": label, "output_throughput": tok_s, "ttft_ms_p50": ttft,
                       "failed": failed, "failed_by_reason": {"sse error": failed} if failed else {}})


def test_runs_group_by_server_and_skip_summaries(tmp_path):
    lines = [_run("pagedserve round 1", 3000.0, 50.0), _run("vllm round 1", 2500.0, 70.0),
             "not json", json.dumps({"summary": True, "rounds": 2}),
             _run("vllm round 2", 2600.0, 65.0), _run("pagedserve round 2", 3100.0, 45.0),
             _run("solo", 10.0, 1.0)]
    by = compare_runs.load_runs(lines)
    assert {k: [r["output_throughput"] for r in v] for k, v in by.items()} == {
        "pagedserve": [3000.0, 3100.0], "vllm": [2500.0, 2600.0], "solo": [10.0]}

    src = tmp_path / "runs.jsonl"
    src.write_text("\n".join(lines))
    out = tmp_path / "plot.png"
    compare_runs.main([str(src), "--plot", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_with_failures_fails_the_comparison(tmp_path, capsys):
    src = tmp_path / "runs.jsonl"
    src.write_text("\n".join([_run("pagedserve round 1", 3000.0, 50.0),
                              _run("vllm round 1", 2500.0, 70.0, failed=3)]))
    with pytest.raises(SystemExit) as exc:
        compare_runs.main([str(src)])
    assert exc.value.code == "compare_runs: 1 of 2 runs had failures; their figures are not comparable"
    out, err = capsys.readouterr()
    assert json.loads(out)["ratio_output_throughput"] == 3000 / 2500  # the summary still printed
    assert "run 'vllm round 1' had 3 failed requests {'sse error': 3}" in err
    assert "pagedserve round 1" not in err

    # a line that does not say how many of its requests failed cannot be trusted either
    src.write_text(json.dumps({"label": "vllm round 1", "output_throughput": 1.0}))
    with pytest.raises(SystemExit):
        compare_runs.main([str(src)])
    assert "does not say how many requests failed" in capsys.readouterr().err


def test_summary_pairs_rounds():
    lines = [_run("pagedserve round 1", 3000.0, 50.0), _run("vllm round 1", 2500.0, 100.0),
             _run("vllm round 2", 2000.0, 40.0), _run("pagedserve round 2", 3000.0, 60.0),
             _run("pagedserve round 3", 1000.0, 10.0)]  # no vLLM round 3: no ratio from it
    s = compare_runs.summarize(compare_runs.load_runs(lines))
    assert s["rounds"] == 3
    assert s["pagedserve"] == {"output_throughput": 3000.0, "ttft_ms_p50": 50.0}
    assert s["vllm"] == {"output_throughput": 2250.0, "ttft_ms_p50": 70.0}
    assert s["ratio_output_throughput"] == (3000 / 2500 + 3000 / 2000) / 2
    assert s["ratio_ttft_ms_p50"] == (0.5 + 1.5) / 2
    assert "ratio_tpot_ms_p50" not in s


def _offline(backend: str, tok_s: float, isa: str, dtype: str = "float32") -> str:
    return json.dumps({"backend": backend, "model": "tiny", "output_tok_s": tok_s,
                       "dtype": dtype, "cpu": {"class": isa, "machine_class": "avx512_bf16"}})


def test_class_table_groups_offline_runs_by_class_and_dtype(tmp_path):
    import class_table

    lines = [_offline("engine", 1800.0, "avx2"), _offline("vllm", 1500.0, "avx2"),
             _offline("engine", 1900.0, "avx2"), _offline("vllm", 1400.0, "avx2"),
             _offline("engine", 2000.0, "avx512"), "### a heading", '{"ratios": {}}',
             _offline("engine", 2600.0, "avx512_bf16", "bfloat16"),
             _offline("vllm", 2000.0, "avx512_bf16", "bfloat16")]
    table = class_table.rows(class_table.load(lines))
    assert table == [
        {"model": "tiny", "class": "avx2", "dtype": "float32", "runs": 2,
         "pagedserve": 1850.0, "vllm": 1450.0, "ratio": 1.28},
        {"model": "tiny", "class": "avx512", "dtype": "float32", "runs": 1,
         "pagedserve": 2000.0, "vllm": None, "ratio": None},
        {"model": "tiny", "class": "avx512_bf16", "dtype": "bfloat16", "runs": 1,
         "pagedserve": 2600.0, "vllm": 2000.0, "ratio": 1.3}]
    assert "| tiny | avx2 | float32 | 1850.0 | 1450.0 | 1.28x | 2 |" in class_table.markdown(table)
    out = tmp_path / "classes.png"
    class_table.plot(table, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _record_runs(tmp_path, *commands: str) -> subprocess.CompletedProcess:
    """serve_vs_vllm.sh's and serve_ab.sh's way to run rounds (load_tests/runs.sh)."""
    runs = "; ".join(f"record_run {tmp_path / 'runs.jsonl'} 'round {i}' {c}"
                     for i, c in enumerate(commands, 1))
    script = f"set -euo pipefail; source load_tests/runs.sh; {runs}; runs_exit KEPT; echo end"
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_a_failing_run_does_not_stop_the_rounds_but_sets_the_exit_status(tmp_path):
    proc = _record_runs(tmp_path, "echo one", "sh -c 'echo two; exit 3'", "sh -c 'exit 4'",
                        "echo four")
    assert proc.returncode == 3  # the first failing run's status
    assert proc.stdout == "one\ntwo\nfour\n"  # every round ran, "end" never printed
    assert (tmp_path / "runs.jsonl").read_text() == "one\ntwo\nfour\n"
    assert 'run "round 2" exited 3' in proc.stderr and 'run "round 3" exited 4' in proc.stderr
    assert "the runs' JSON lines: KEPT" in proc.stderr

    proc = _record_runs(tmp_path, "echo one", "echo two")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "one\ntwo\nend\n", "")
