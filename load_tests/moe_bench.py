"""The CPU candidates for the fused MoE MLP (``kernels/fused_moe.py``), timed on this machine:
a loop over experts (index_select + mm, ``fused_moe_ref``), ``torch.bmm`` over groups padded to
the largest, and ``torch._grouped_mm`` over the expert-sorted rows (``fused_moe_cpu``).
Prints one JSON line: the fastest call's ms (candidates timed in turn) for each candidate and token count.

    python -m load_tests.moe_bench [--hidden 1024 --inter 3584 --experts 8 --top-k 2]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.fused_moe import fused_moe_cpu, fused_moe_ref, sort_by_expert


def fused_moe_bmm(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert's rows padded to the largest group, then one torch.bmm per projection."""
    t, k = topk_ids.shape
    e = w13.shape[0]
    order, counts = sort_by_expert(topk_ids, e)
    longest = int(counts.max())
    start = counts.cumsum(0) - counts
    experts = topk_ids.reshape(-1)[order]
    slot = torch.arange(t * k) - start[experts]
    padded = x.new_zeros(e, longest, x.shape[1])
    padded[experts, slot] = x[order // k]
    h = torch.bmm(padded, w13.transpose(1, 2))
    h = F.silu(h[..., : w2.shape[2]]) * h[..., w2.shape[2]:]
    y = torch.bmm(h, w2.transpose(1, 2))[experts, slot]
    y = y * topk_weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, y)


CANDIDATES: dict[str, Callable[..., torch.Tensor]] = {
    "loop": fused_moe_ref, "bmm": fused_moe_bmm, "grouped_mm": fused_moe_cpu}


def _best_ms(calls: dict[str, Callable[[], torch.Tensor]], reps: int) -> dict[str, float]:
    """Each call's fastest of ``reps`` runs in ms, the calls taken in turn (round robin), so
    that load from other processes falls on all of them alike."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps + 1):  # the first round warms up
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: round(t * 1000, 2) for name, t in best.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=3584)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", default="4,64,512")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    torch.manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    dtype = getattr(torch, args.dtype)
    w13, w2 = (torch.randn(e, 2 * i, h) * 0.02).to(dtype), (torch.randn(e, h, i) * 0.02).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    result: dict[str, object] = {"hidden": h, "inter": i, "experts": e, "top_k": args.top_k,
                                 "dtype": args.dtype,
                                 "threads": torch.get_num_threads(), "ms": {}}
    for t in map(int, args.tokens.split(",")):
        x = torch.randn(t, h).to(dtype)
        probs, ids = torch.softmax(torch.randn(t, e), -1).topk(args.top_k, -1)
        want = fused_moe_ref(x, w13, w2, probs, ids)
        call = (x, w13, w2, probs, ids)
        for fn in CANDIDATES.values():
            torch.testing.assert_close(fn(*call), want, atol=tol, rtol=tol)
        timed = _best_ms({n: lambda fn=fn, call=call: fn(*call) for n, fn in CANDIDATES.items()},
                         args.reps)
        for name, ms in timed.items():
            result["ms"].setdefault(name, {})[t] = ms  # type: ignore[union-attr]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
