"""CPU linear layers: this project's prepacked product beside oneDNN's, on a model's weights.

Every linear weight of a 24-layer model of the 0.5B shape (or ``--shape``) is packed both ways,
so a pass over the layers reads its weights from memory as a decode step does (they do not fit
in the caches). For each row count the two run alternately, ``--rounds`` times; the medians
and their ratio are printed as one JSON line per row count, with the CPU class.

    .venv/bin/python load_tests/gemm_bench.py --rows 1,8,16,29,64,2048 [--isa avx2]

``--isa`` runs both products as on a CPU of that class at most (this project's kernels built and
chosen for it, oneDNN capped the same way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_throughput as ot  # noqa: E402  (after the path)

from engine.executor.cpu_runtime import keep_freed_memory  # noqa: E402
from kernels import cpu_gemm, settings  # noqa: E402
from kernels.cpu_gemm import Packed  # noqa: E402

# (in, out) of the 0.5B shape's qkv, o, gate_up and down projections
SHAPES = {"0.5b": [(896, 1152), (896, 896), (896, 9728), (4864, 896)]}


def run_layers(weights: list[list[Packed]], inputs: dict[int, torch.Tensor],
               shapes: list[tuple[int, int]]) -> None:
    for layer in weights:
        for (k, _), w in zip(shapes, layer, strict=True):
            cpu_gemm.packed_linear(inputs[k], w, None)


def seconds(fn: Callable[[], None], reps: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,29,64,256,2048")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--isa", choices=ot.CPU_CLASSES, default=None)
    args = parser.parse_args(argv)
    ot.apply_isa_cap(args.isa)
    if args.isa:
        settings.configure(isa_cap=args.isa)
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine: outputs reuse freed memory, no page faults per call
    shapes, dtype = SHAPES[args.shape], getattr(torch, args.dtype)
    plain = [[torch.randn(n, k).to(dtype) for k, n in shapes] for _ in range(args.layers)]
    ours = [[cpu_gemm.pack(w) for w in layer] for layer in plain]
    onednn = [[cpu_gemm.pack_onednn(w) for w in layer] for layer in plain]
    del plain
    kernel = "c" if isinstance(ours[0][0], cpu_gemm.DensePacked) else "onednn"
    macs = sum(k * n for k, n in shapes) * args.layers
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k).to(dtype) for k in {k for k, _ in shapes}}
        times: dict[str, list[float]] = {"pagedserve": [], "onednn": []}
        for w in (ours, onednn):
            run_layers(w, inputs, shapes)  # first touch, kernel builds
        for _ in range(args.rounds):
            for name, w in (("pagedserve", ours), ("onednn", onednn)):
                times[name].append(seconds(lambda w=w, x=inputs: run_layers(w, x, shapes)))
        med = {name: statistics.median(t) for name, t in times.items()}
        print(json.dumps({
            "rows": m, "layers": args.layers, "dtype": args.dtype, "pagedserve_kernel": kernel,
            "pagedserve_ms": round(med["pagedserve"] * 1e3, 2),
            "onednn_ms": round(med["onednn"] * 1e3, 2),
            "pagedserve_gflops": round(2 * m * macs / med["pagedserve"] / 1e9, 1),
            "speedup": round(med["onednn"] / med["pagedserve"], 3),
            "cpu_class": settings.isa_class(), "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
