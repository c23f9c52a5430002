"""Two or more builds of the dense C kernel (``kernels/csrc/dense_linear_cpu.c`` variants) on the
0.5B model's layer shapes, calls interleaved in one process, so the machine's swings (other
tenants, clocks) fall on every build alike. Prints one JSON line per build: min, p25 and median
milliseconds for ``--layers`` layers' products (their weights larger than L3, as in a step).

    python load_tests/dense_ab.py --sources old.c,kernels/csrc/dense_linear_cpu.c --rows 16

``--shapes`` replaces the layer's weights (OUTxIN; ``151936x896``: the 0.5B LM head). ``--march``
picks the class (``native``; ``haswell`` for AVX2, ``skylake-avx512`` for AVX-512
without bf16). Every build must give the same output as the first.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down (0.5B)


def _build(source: str, march: str, out_dir: str, i: int) -> ctypes.CDLL:
    so = f"{out_dir}/v{i}.so"
    subprocess.run(["gcc", "-O3", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=fast",
                    "-fno-math-errno", "-fno-trapping-math", f"-march={march}",
                    f"-I{ROOT / 'kernels' / 'csrc'}", source, "-o", so], check=True)
    return ctypes.CDLL(so)


def _pack(lib: ctypes.CDLL, ws: list[torch.Tensor], code: int, threads: int) -> list[torch.Tensor]:
    pw = lib.dense_supported_cpu(code)
    if not pw:
        raise SystemExit("this build has no kernel for the dtype on this -march")
    packs = []
    for w in ws:
        n, k = w.shape
        kk = (k + 1) // 2 * 2 if code == 1 else k
        p = torch.empty(((n + pw - 1) // pw) * pw * kk, dtype=w.dtype)
        lib.dense_pack_cpu(ctypes.c_void_p(p.data_ptr()), ctypes.c_void_p(w.data_ptr()),
                           ctypes.c_int64(n), ctypes.c_int64(k), code, threads)
        packs.append(p)
    return packs


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", required=True, help="comma-separated C files")
    ap.add_argument("--march", default="native")
    ap.add_argument("--rows", type=int, default=29)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="weights as OUTxIN, comma-separated (151936x896: the 0.5B LM head)")
    args = ap.parse_args(argv)
    shapes = [(int(n), int(k)) for n, k in (s.split("x") for s in args.shapes.split(","))]
    sources = args.sources.split(",")
    dt, code = (torch.bfloat16, 1) if args.dtype == "bfloat16" else (torch.float32, 0)
    torch.manual_seed(0)
    ws = [torch.randn(n, k, dtype=dt) * 0.05 for n, k in shapes * args.layers]
    xs = {k: torch.randn(args.rows, k, dtype=dt) for k in {k for _, k in shapes}}
    outs = [torch.empty(args.rows, w.shape[0], dtype=dt) for w in ws]
    with tempfile.TemporaryDirectory() as tmp:
        libs = [_build(s, args.march, tmp, i) for i, s in enumerate(sources)]
        packs = [_pack(lib, ws, code, args.threads) for lib in libs]

        def run(i: int) -> float:
            start = time.perf_counter()
            for w, p, o in zip(ws, packs[i], outs):
                n, k = w.shape
                libs[i].dense_linear_cpu(
                    ctypes.c_void_p(o.data_ptr()), ctypes.c_void_p(xs[k].data_ptr()),
                    ctypes.c_void_p(p.data_ptr()), None, ctypes.c_int64(args.rows),
                    ctypes.c_int64(n), ctypes.c_int64(k), ctypes.c_int64(k), ctypes.c_int64(n),
                    code, args.threads)
            return time.perf_counter() - start

        first = None
        for i in range(len(libs)):
            run(i)
            if first is None:
                first = [o.clone() for o in outs]
            elif not all(torch.equal(a, b) for a, b in zip(first, outs)):
                raise SystemExit(f"{sources[i]} gives other outputs than {sources[0]}")
        times: list[list[float]] = [[] for _ in libs]
        for _ in range(args.rounds):
            for i in range(len(libs)):
                times[i].append(run(i))
    flops = 2 * args.rows * sum(w.numel() for w in ws)
    rows: list[dict[str, object]] = []
    for source, t in zip(sources, times):
        t.sort()
        rows.append({"source": source, "march": args.march, "rows": args.rows,
                     "dtype": args.dtype, "min_ms": round(t[0] * 1e3, 2),
                     "p25_ms": round(t[len(t) // 4] * 1e3, 2),
                     "median_ms": round(statistics.median(t) * 1e3, 2),
                     "gflops_p25": round(flops / t[len(t) // 4] / 1e9, 1),
                     "threads": args.threads})
        print(json.dumps(rows[-1]))
    return rows


if __name__ == "__main__":
    main()
