"""load_tests/kernel_bench.py --smoke runs end to end on the CPU (references, tiny sizes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
