"""Every Triton kernel variant the engine launches compiles for sm_90 (H100/H200) and sm_80
(A100) with Triton's real compiler, without a GPU (``tests/kernels/gpu_compile.py``, run in a
process of its own: the interpreter the other kernel tests use has no compiler). Fails on any
compile error, on register spills in the bfloat16/float16 decode paths (the mixed kernel's
decode variant and split-KV), which run once per generated token, on shared memory over a
target's per-block limit (a launch there would fail; fp8 KV variants are built for sm_90 only,
as sm_80 has no fp8 E4M3), and when decoding at a longer context
needs another variant (a compile under traffic). The per-kernel summary of
registers, spills and shared memory is printed (``pytest -s``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"_paged_attention_kernel", "_split_kernel", "_reduce_kernel", "_store_kv_kernel",
           "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel", "_w8a16_kernel",
           "_fused_moe_kernel"}
TARGETS = ("sm_90", "sm_80")
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}  # per thread block (H100/H200, A100)


def _ptxas() -> Path | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return path if path.exists() else None


@pytest.mark.timeout(1800)
@pytest.mark.skipif(_ptxas() is None, reason="Triton or its NVIDIA backend (ptxas) not installed")
def test_every_kernel_variant_compiles_for_hopper_and_ampere(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.gpu_compile",
                           "--targets", ",".join(TARGETS)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [r for r in lines if not r.get("summary")]
    errors = [f"{r['target']} {r['label']} ({r['kernel']}): {r['error']}"
              for r in results if "error" in r]
    assert not errors, "\n".join(errors[:5])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {(r["kernel"], r["target"]) for r in results} == \
        {(k, t) for k in KERNELS for t in TARGETS}
    summary = lines[-1]
    assert summary["summary"] and summary["failed"] == 0
    assert summary["compiled"] == len(results) == summary["jobs"]
    fp8 = [r for r in results if "*fp8e4nv" in r["arg_types"]]  # fp8 KV: sm_90 only
    assert fp8 and {r["target"] for r in fp8} == {"sm_90"}
    assert len(results) == summary["variants"] * len(TARGETS) - len(fp8)
    spilling = [f"{r['target']} {r['label']}: {r['spill_bytes']} bytes"
                for r in results if r["spill_bytes"] > 0
                and r["label"].startswith(("attention decode", "attention split"))
                and set(r["arg_types"]) & {"*bf16", "*fp16"}]
    assert not spilling, "register spills in decode paths:\n" + "\n".join(spilling)
    too_big = [f"{r['target']} {r['label']}: {r['shared_bytes']} bytes"
               for r in results if r["shared_bytes"] > SHARED_LIMIT[r["target"]]]
    assert not too_big, "shared memory over the GPU's limit (fails at launch):\n" + \
        "\n".join(too_big)
    for kernel in ("_paged_attention_kernel", "_split_kernel", "_reduce_kernel"):
        for dtype in ("bf16", "fp16", "fp32"):  # one variant for every context length
            mode = "decode" if kernel == "_paged_attention_kernel" else "split"
            wanted = {f"attention {mode} {dtype} llama-3-8b context {n}"
                      for n in (1024, 8192, 131072)}
            hits = [r for r in results if r["kernel"] == kernel and r["target"] == "sm_90"
                    and wanted & set(r["labels"])]
            assert len(hits) == 1 and wanted <= set(hits[0]["labels"]), (kernel, dtype)
    print(_table(results))


def _table(results: list[dict]) -> str:
    rows: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in results:
        rows[(r["kernel"], r["target"])].append(r)
    out = ["kernel | target | variants | registers (max) | spill bytes (max) | shared KiB (max)",
           "---|---|---|---|---|---"]
    for (kernel, target), rs in sorted(rows.items()):
        out.append(f"{kernel} | {target} | {len(rs)} | {max(r['registers'] for r in rs)} | "
                   f"{max(r['spill_bytes'] for r in rs)} | "
                   f"{max(r['shared_bytes'] for r in rs) / 1024:.1f}")
    return "\n".join(out)
