"""Kernel benchmarks, each figure beside a peer measured in the same run.

Memory-bound kernels report GB/s next to a device-to-device copy of the same byte volume
(`torch.empty_like(x).copy_(x)`), and the time of the unfused torch ops they replace. Paged
attention reports GB/s (decode) or TFLOP/s (prefill) next to
`torch.nn.functional.scaled_dot_product_attention` over the same K/V already gathered into dense
tensors (the paging costs nothing there, so it is the bar to reach).

    python3 load_tests/kernel_bench.py            # on a GPU: Triton kernels, full sizes
    python3 load_tests/kernel_bench.py --smoke    # anywhere: the torch references, tiny sizes

One JSON line per benchmark on stdout (also appended to --json), then a short table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import ops, settings  # noqa: E402
from kernels.paged_attention import gather_kv_ref  # noqa: E402


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after warm-up (CUDA events on the GPU)."""
    for _ in range(2):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) / 1e3


def copy_gbps(num_bytes: int, dtype: torch.dtype, device: torch.device, iters: int) -> float:
    """GB/s of a device copy that reads num_bytes/2 and writes num_bytes/2."""
    x = torch.empty(max(num_bytes // 2 // dtype.itemsize, 1), dtype=dtype, device=device)
    return num_bytes / timed(lambda: torch.empty_like(x).copy_(x), device, iters) / 1e9


def record(name: str, shape: str, seconds: float, *, num_bytes: int = 0, flops: float = 0.0,
           peer: str = "", peer_seconds: float = 0.0, copy: float = 0.0) -> dict:
    row = {"bench": name, "shape": shape, "ms": round(seconds * 1e3, 4)}
    if num_bytes:
        row["gbps"] = round(num_bytes / seconds / 1e9, 1)
    if copy:
        row["copy_gbps"] = round(copy, 1)
        row["pct_of_copy"] = round(100 * row["gbps"] / copy, 1)
    if flops:
        row["tflops"] = round(flops / seconds / 1e12, 2)
    if peer:
        row.update(peer=peer, peer_ms=round(peer_seconds * 1e3, 4), speedup=round(peer_seconds / seconds, 2))
    print(json.dumps(row), flush=True)
    return row


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What an unfused model does (Hugging Face Llama)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def bench_norms(cfg: dict, dev: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    tokens, hidden = cfg["tokens"], cfg["hidden"]
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=dev, dtype=dtype)
    shape, size = f"T={tokens} H={hidden}", x.numel() * x.element_size()

    def unfused_add_norm():
        res.add_(x)
        return rms_norm_torch(res, w, 1e-6)

    return [
        record("rms_norm", shape, timed(lambda: ops.rms_norm(x, w, 1e-6), dev, iters), num_bytes=2 * size,
               copy=copy_gbps(2 * size, dtype, dev, iters), peer="torch ops",
               peer_seconds=timed(lambda: rms_norm_torch(x, w, 1e-6), dev, iters)),
        record("fused_add_rms_norm", shape,
               timed(lambda: ops.fused_add_rms_norm(x, res, w, 1e-6), dev, iters), num_bytes=4 * size,
               copy=copy_gbps(4 * size, dtype, dev, iters), peer="add_ + torch rms_norm",
               peer_seconds=timed(unfused_add_norm, dev, iters)),
    ]


def bench_silu(cfg: dict, dev: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    tokens, inter = cfg["tokens"], cfg["intermediate"]
    x = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)
    size = 3 * tokens * inter * x.element_size()
    return [record("silu_and_mul", f"T={tokens} I={inter}", timed(lambda: ops.silu_and_mul(x), dev, iters),
                   num_bytes=size, copy=copy_gbps(size, dtype, dev, iters), peer="F.silu(gate) * up",
                   peer_seconds=timed(lambda: F.silu(x[:, :inter]) * x[:, inter:], dev, iters))]


def bench_rotary_and_store(cfg: dict, dev: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    tokens, hq, hk, d, bs = cfg["tokens"], cfg["q_heads"], cfg["kv_heads"], cfg["head_size"], cfg["block_size"]
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=dev, dtype=dtype)
    q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
    cache = torch.randn(8192, d, device=dev)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    rope_bytes = 2 * (hq + hk) * d * tokens * qkv.element_size()
    shape = f"T={tokens} Hq={hq} Hk={hk} D={d}"
    with settings.backend("reference"):
        rope_ref = timed(lambda: ops.rotary_embedding(pos, q, k, cache, d), dev, iters)
    rows = [record("rotary_embedding", shape, timed(lambda: ops.rotary_embedding(pos, q, k, cache, d), dev, iters),
                   num_bytes=rope_bytes, copy=copy_gbps(rope_bytes, dtype, dev, iters),
                   peer="torch reference", peer_seconds=rope_ref)]
    key = k.view(tokens, hk, d)
    value = qkv[:, (hq + hk) * d :].view(tokens, hk, d)
    kv = torch.empty(math.ceil(tokens / bs) + 8, 2, bs, hk, d, device=dev, dtype=dtype)
    slots = torch.randperm(tokens, device=dev)
    store_bytes = 4 * tokens * hk * d * qkv.element_size()
    with settings.backend("reference"):
        store_ref = timed(lambda: ops.store_kv_cache(key, value, kv[:, 0], kv[:, 1], slots), dev, iters)
    rows.append(record("store_kv_cache", shape + f" bs={bs}",
                       timed(lambda: ops.store_kv_cache(key, value, kv[:, 0], kv[:, 1], slots), dev, iters),
                       num_bytes=store_bytes, copy=copy_gbps(store_bytes, dtype, dev, iters),
                       peer="torch index_put", peer_seconds=store_ref))
    return rows


def paged_batch(seq_lens: list[int], query_lens: list[int], cfg: dict, dev: torch.device, dtype: torch.dtype):
    """Random paged cache with shuffled blocks, and the flat query batch for these sequences."""
    hq, hk, d, bs = cfg["q_heads"], cfg["kv_heads"], cfg["head_size"], cfg["block_size"]
    per_seq = [math.ceil(n / bs) for n in seq_lens]
    kv = torch.randn(sum(per_seq) + 1, 2, bs, hk, d, device=dev, dtype=dtype)
    ids = torch.randperm(sum(per_seq), device=dev).int()
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device=dev)
    for b, start in enumerate([0, *torch.tensor(per_seq).cumsum(0).tolist()[:-1]]):
        tables[b, : per_seq[b]] = ids[start : start + per_seq[b]]
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    query = torch.randn(starts[-1], hq, d, device=dev, dtype=dtype)
    return (query, kv[:, 0], kv[:, 1], tables, torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev), d**-0.5, max(query_lens), max(seq_lens))


def sdpa_dense(args: tuple, causal: bool) -> Callable[[], torch.Tensor]:
    """SDPA over the same K/V gathered into dense [B, Hk, L, D] (equal-length sequences)."""
    query, k_cache, v_cache, tables, seq_lens, _, scale, q_len, seq_len = args
    batch, hq = tables.shape[0], query.shape[1]
    k = gather_kv_ref(k_cache, tables, seq_len).transpose(1, 2).contiguous()
    v = gather_kv_ref(v_cache, tables, seq_len).transpose(1, 2).contiguous()
    q = query.view(batch, q_len, hq, -1).transpose(1, 2)
    try:
        F.scaled_dot_product_attention(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    except TypeError:  # torch < 2.5: expand the kv heads up front (the peer then reads G x more)
        group = hq // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def bench_attention(cfg: dict, dev: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    hq, hk, d = cfg["q_heads"], cfg["kv_heads"], cfg["head_size"]
    heads = f"Hq={hq} Hk={hk} D={d} bs={cfg['block_size']}"
    rows = []
    for name, batch, ctx in (("decode", cfg["decode_batch"], cfg["decode_ctx"]),
                             ("decode_long", cfg["long_batch"], cfg["long_ctx"])):
        args = paged_batch([ctx] * batch, [1] * batch, cfg, dev, dtype)
        kv_bytes = 2 * batch * ctx * hk * d * args[0].element_size()
        rows.append(record(f"paged_attention_{name}", f"B={batch} ctx={ctx} {heads}",
                           timed(lambda a=args: ops.paged_attention(*a), dev, iters), num_bytes=kv_bytes,
                           copy=copy_gbps(kv_bytes, dtype, dev, iters), peer="SDPA on gathered KV",
                           peer_seconds=timed(sdpa_dense(args, causal=False), dev, iters)))
        if name == "decode_long" and dev.type == "cuda" and settings.current().backend != "reference":
            from kernels.paged_attention import paged_attention_triton

            unified = timed(lambda a=args: paged_attention_triton(*a, split_kv=False), dev, iters)
            rows.append(record("paged_attention_decode_long_split_vs_unified", f"B={batch} ctx={ctx} {heads}",
                               timed(lambda a=args: paged_attention_triton(*a, split_kv=True), dev, iters),
                               num_bytes=kv_bytes, peer="unified kernel (no split)", peer_seconds=unified))
    batch, length = cfg["prefill_batch"], cfg["prefill_len"]
    args = paged_batch([length] * batch, [length] * batch, cfg, dev, dtype)
    flops = 4 * batch * hq * d * length * (length + 1) / 2  # causal: QK^T and PV over half the square
    rows.append(record("paged_attention_prefill", f"B={batch} L={length} {heads}",
                       timed(lambda: ops.paged_attention(*args), dev, iters), flops=flops,
                       peer="SDPA causal on gathered KV", peer_seconds=timed(sdpa_dense(args, causal=True), dev, iters)))
    rows.append(bench_mixed(cfg, dev, dtype, iters, heads))
    return rows


def bench_mixed(cfg: dict, dev: torch.device, dtype: torch.dtype, iters: int, heads: str) -> dict:
    """One prefill chunk over a cached prefix plus many decodes, in one call."""
    chunk, cached, decodes, ctx = cfg["mixed_chunk"], cfg["mixed_cached"], cfg["decode_batch"] - 1, cfg["decode_ctx"]
    args = paged_batch([cached + chunk] + [ctx] * decodes, [chunk] + [1] * decodes, cfg, dev, dtype)
    with settings.backend("reference"):
        reference = timed(lambda: ops.paged_attention(*args), dev, iters)
    return record("paged_attention_mixed", f"chunk={chunk}+{cached} cached, {decodes} decodes ctx={ctx} {heads}",
                  timed(lambda: ops.paged_attention(*args), dev, iters), peer="torch reference",
                  peer_seconds=reference)


GPU = dict(tokens=16384, hidden=4096, intermediate=14336, q_heads=32, kv_heads=8, head_size=128,
           block_size=16, decode_batch=64, decode_ctx=2048, long_batch=2, long_ctx=32768,
           prefill_batch=4, prefill_len=2048, mixed_chunk=512, mixed_cached=1536)
SMOKE = dict(tokens=16, hidden=64, intermediate=48, q_heads=4, kv_heads=2, head_size=32,
             block_size=8, decode_batch=3, decode_ctx=40, long_batch=1, long_ctx=100,
             prefill_batch=2, prefill_len=24, mixed_chunk=8, mixed_cached=12)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'benchmark':46} {'ms':>9} {'GB/s':>8} {'%copy':>6} {'TFLOP/s':>8} {'peer ms':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['bench']:46} {r['ms']:9.3f} {r.get('gbps', ''):>8} {r.get('pct_of_copy', ''):>6} "
              f"{r.get('tflops', ''):>8} {r.get('peer_ms', ''):>9} {r.get('speedup', ''):>7}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes with the torch references (CPU)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if dev.type != "cuda" and not args.smoke:
        parser.error("no CUDA device: run with --smoke")
    cfg, iters = (SMOKE, 2) if args.smoke else (GPU, args.iters)
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    torch.manual_seed(0)
    with settings.backend("reference" if args.smoke else "auto"):
        rows = [row for bench in (bench_norms, bench_silu, bench_rotary_and_store, bench_attention)
                for row in bench(cfg, dev, dtype, iters)]
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
