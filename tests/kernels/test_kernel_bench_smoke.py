"""load_tests/kernel_bench.py --smoke runs end to end on the CPU (references, tiny sizes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kernels import cpu_gemm

BENCH = Path(__file__).resolve().parents[2] / "load_tests" / "kernel_bench.py"


def test_kernel_bench_smoke(capsys):
    spec = importlib.util.spec_from_file_location("kernel_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(["--smoke"])
    names = [r["bench"] for r in rows]
    assert names == [
        "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding", "store_kv_cache",
        "paged_attention_decode", "paged_attention_decode_long", "paged_attention_prefill",
        "paged_attention_mixed",
    ]
    assert all(r["ms"] > 0 and r["peer_ms"] > 0 for r in rows)
    assert "benchmark" in capsys.readouterr().out


@pytest.mark.skipif(not cpu_gemm.packing_supported(torch.empty(2, 2, dtype=torch.bfloat16)),
                    reason="bfloat16 products are prepacked only where bfloat16 is native")
def test_gemm_bench_prints_both_products(capsys):
    path = BENCH.with_name("gemm_bench.py")
    spec = importlib.util.spec_from_file_location("gemm_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--rows", "1,7", "--layers", "1", "--rounds", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["rows"] for r in lines] == [1, 7]
    used = cpu_gemm.dense_kernel_used(torch.empty(2, 2, dtype=torch.bfloat16))
    assert all(r["pagedserve_kernel"] == ("c" if used else "onednn") for r in lines)
    assert all(r["pagedserve_ms"] > 0 and r["onednn_ms"] > 0 for r in lines)


@pytest.mark.skipif(not cpu_gemm.dense_kernel_used(torch.empty(2, 2)),
                    reason="no float32 dense C kernel on this CPU class")
def test_dense_ab_times_builds_and_rejects_one_that_computes_otherwise(tmp_path, capsys):
    path = BENCH.with_name("dense_ab.py")
    spec = importlib.util.spec_from_file_location("dense_ab", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    source = BENCH.parents[1] / "kernels" / "csrc" / "dense_linear_cpu.c"
    text = source.read_text()
    same = tmp_path / "same.c"  # another prefetch hint: the same sums
    same.write_text(text.replace("_MM_HINT_T2", "_MM_HINT_T0"))
    other = tmp_path / "other.c"  # partial sums of 64 inputs: other roundings
    other.write_text(text.replace("#define KC 128", "#define KC 64"))
    assert same.read_text() != text and other.read_text() != text
    argv = ["--rows", "7", "--layers", "1", "--rounds", "2", "--dtype", "float32"]
    rows = module.main(["--sources", f"{source},{same}", *argv])
    assert [r["source"] for r in rows] == [str(source), str(same)]
    assert all(0 < r["min_ms"] <= r["p25_ms"] <= r["median_ms"] for r in rows)
    assert len(capsys.readouterr().out.splitlines()) == 2
    with pytest.raises(SystemExit, match="other outputs"):
        module.main(["--sources", f"{source},{other}", *argv])
    # --shapes: with 40 inputs (one block of either size) the two builds agree, as they do not
    # on the default shapes or on 200 inputs
    shaped = module.main(["--sources", f"{source},{other}", *argv, "--shapes", "70x40,33x40"])
    assert len(shaped) == 2 and all(r["min_ms"] > 0 for r in shaped)
    with pytest.raises(SystemExit, match="other outputs"):
        module.main(["--sources", f"{source},{other}", *argv, "--shapes", "70x40,70x200"])
