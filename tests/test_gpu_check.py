"""``load_tests/gpu_check.sh`` end to end in its CPU dry run, so the one script a GPU session
runs cannot rot: every step reports, CUDA steps SKIP with their reason, the engine step and the
performance step run the tiny model on the CPU, the verdict is written as it goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(tmp_path),
           "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", "load_tests/gpu_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = {r["step"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert {k: v["status"] for k, v in steps.items()} == {
        "preflight": "PASS", "kernel_tests": "SKIP", "engine": "PASS", "nccl_graph": "SKIP",
        "start_time": "PASS", "performance": "PASS"}
    assert "CUDA" in steps["kernel_tests"]["reason"]
    engine = steps["engine"]
    assert engine["kernels_vs_reference"]["parted"] == []  # float32: no near ties decided apart
    assert engine["kernels_vs_reference"]["max_logprob_diff"] < 1e-3
    assert engine["hf_teacher_forced"]["top1_agreement"] >= 0.95
    assert engine["kv"]["num_blocks"] > 0 and engine["kv"]["weight_bytes"] > 0
    start = steps["start_time"]  # a fresh interpreter's imports, engine phases and TTFTs
    assert start["model"] == "tiny" and start["device"] == "cpu"
    assert list(start["engine"]) == ["engine_setup", "model_init", "weight_load", "pack",
                                     "warm_up", "kv_alloc", "cuda_graphs"]
    assert start["imports"] > 0 and start["build"] > 0 and len(start["ttft_first_second_third"]) == 3
    assert start["seconds_to_ready"] == round(start["imports"] + start["build"], 3)
    perf = steps["performance"]
    assert [(r["batch"], r["context"]) for r in perf["decode"]] == [(1, 64), (4, 64)]
    assert all(r["ms_per_step"] > 0 and r["hbm_floor_ms"] > 0 for r in perf["decode"])
    assert perf["vs_hf"]["engine_tok_s"] > 0 and perf["vs_hf"]["hf_tok_s"] > 0
    # where a decode step's time goes, at batch 1 and the largest batch
    assert list(perf["step_profile"]) == ["batch 1 context 64", "batch 4 context 64"]
    for profile in perf["step_profile"].values():
        parts = ("schedule", "prepare", "forward", "logits", "sample", "other")
        assert all(profile[p] > 0 for p in parts)
        assert abs(sum(profile[p] for p in parts) - profile["step"]) < 1e-2
    assert [r["batch"] for r in perf["int8_decode"]] == [1, 4]
    assert all(r["speedup_vs_plain"] > 0 for r in perf["int8_decode"])
    assert [r["batch"] for r in perf["fp8_decode"]] == [1, 4]
    # fp8 KV on the dry run's float32 engine: a quarter of the bytes per block, from 64 MiB each
    assert [(r["batch"], r["kv_blocks_vs_plain"]) for r in perf["fp8_kv_decode"]] == \
        [(1, 4.0), (4, 4.0)]
    assert proc.stdout.rstrip().splitlines()[-2] == "PASS"  # the verdict line


def _run(tokens, logprobs):
    from types import SimpleNamespace

    return SimpleNamespace(token_ids=tokens, logprobs=logprobs)


def test_greedy_runs_may_part_only_at_a_near_tie():
    sys.path.insert(0, str(ROOT / "load_tests"))
    from gpu_check import TIE_TOL, _compare

    a = [_run([5, 7, 9], [{5: -1.0, 6: -3.0}, {7: -2.0, 8: -2.05}, {9: -0.5}])]
    # Parts at token 1, a near tie in both runs: passes; the later token is not compared.
    b = [_run([5, 8, 4], [{5: -1.02, 6: -3.0}, {8: -2.01, 7: -2.03}, {4: -9.0}])]
    got = _compare(a, b)
    assert got["parted"] == [{"prompt": 0, "position": 1, "gaps": [0.05, 0.02]}]
    assert got["failures"] == [] and got["max_logprob_diff"] == 0.02
    # The same parting where b's pick is far below a's in a's own logprobs: a failure.
    got = _compare([_run([5, 7], [{5: -1.0}, {7: -2.0, 8: -2.0 - 2 * TIE_TOL}])], b)
    assert got["parted"] == [{"prompt": 0, "position": 1, "gaps": [round(2 * TIE_TOL, 4), 0.02]}]
    assert len(got["failures"]) == 1
    assert got["failures"][0].startswith("prompt 0 parts at token 1 with no near tie")
    # b's pick missing from a's logprobs altogether: an infinite gap, a failure.
    got = _compare([_run([5, 7], [{5: -1.0}, {7: -2.0}])], b)
    assert got["parted"][0]["gaps"][0] == float("inf") and len(got["failures"]) == 1
    # Equal tokens whose logprobs differ beyond the tolerance: a failure.
    got = _compare(a, [_run([5, 7, 9], [{5: -1.2}, {7: -2.0}, {9: -0.5}])])
    assert got["parted"] == [] and got["failures"][0].startswith("chosen tokens' logprobs differ")
