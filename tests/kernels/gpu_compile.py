"""Every Triton kernel variant the engine launches, compiled for real NVIDIA GPUs by Triton's own
compiler, on a machine without one: ``python -m tests.kernels.gpu_compile [--targets sm_90,sm_80]``.

The variants come from the launchers themselves: each scenario calls a real launcher
(``paged_attention_triton``, ``store_kv_cache_triton``, ...) on CPU tensors of the scenario's
shapes with Triton's launch replaced by a recorder, so the set compiled is exactly what those
calls launch on a GPU (their constexprs, argument types and ``num_warps``). Each distinct
variant is compiled (``triton.compile`` of an ``ASTSource`` for a ``GPUTarget``; the pinned
wheel ships ``ptxas``) and its cubin's resource use read back with ``cuobjdump``: registers per
thread, spill bytes (local memory) and shared memory. One JSON line per variant and target.

Scenarios: paged attention (decode, split-KV and its reduce, mixed prefill) for bfloat16,
float16 and float32, head sizes 64, 80, 96, 128 and 256, GQA groups 1-8, the shapes of
Llama-3-8B (32 query heads, 8 kv heads, head size 128) and Qwen2.5-0.5B (14, 2, 64), and
Llama-3-8B's decode at contexts of 1k, 8k and 128k tokens (which must launch the same variants:
lengths and the split count are runtime values); fp8 KV caches read by each dtype at both models' shapes; the KV store (and its fp8 variant), RMSNorm (with and without the
residual), rotary, SiLU-and-multiply and the weight-only int8 matmul (decode and prefill rows,
with and without bias; FP8 weights too) at those models' sizes; the fused MoE's grouped GEMM
(decode and prefill rows) at Mixtral-8x7B's and Qwen3-30B-A3B's sizes; Gemma 2's sliding
window with soft-capped scores (9B: 16, 8, 256; 2B: 8, 4, 256). Run in a process
without ``TRITON_INTERPRET`` (the interpreter has no compiler).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MODELS = {"llama-3-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}
GEMMA_MODELS = {"gemma-2-9b": (16, 8, 256), "gemma-2-2b": (8, 4, 256)}
HEAD_SIZES = (64, 80, 96, 128, 256)
TARGETS = {"sm_90": 90, "sm_80": 80}
BLOCK_SIZE = 16  # the engine's default KV block
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}
FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- recording
def record(call: Callable[[], Any]) -> list[tuple[Any, tuple, dict]]:
    """The launches ``call()`` makes, as (JITFunction, args, kwargs), none of them run."""
    from triton.runtime.jit import KernelInterface

    launches: list[tuple[Any, tuple, dict]] = []
    original = KernelInterface.__getitem__

    def getitem(self: Any, grid: Any) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append((self, args, kwargs))

    KernelInterface.__getitem__ = getitem  # type: ignore[method-assign]
    try:
        call()
    finally:
        KernelInterface.__getitem__ = original  # type: ignore[method-assign]
    return launches


def variant(kernel: Any, args: tuple, kwargs: dict, label: str) -> dict[str, Any]:
    """A launch -> what ``triton.compile`` needs: signature, constexprs, options."""
    names = kernel.arg_names
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for name, value in zip(names, args):
        signature[name] = _type_of(value)
    for name in names[len(args):]:
        if name not in kwargs:
            raise ValueError(f"{kernel.__name__}: no value for {name}")
        signature[name] = "constexpr"
        constexprs[name] = kwargs[name]
    options = {k: v for k, v in kwargs.items() if k not in names}
    return {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "label": label,
            "signature": signature, "constexprs": constexprs, "options": options}


def _type_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected launch argument {value!r}")


# ----------------------------------------------------------------------------- scenarios
def _attention(dtype: torch.dtype, hq: int, hk: int, d: int, mode: str,
               seq_len: int | None = None, kv_dtype: torch.dtype | None = None,
               softcap: float = 0.0) -> None:
    from kernels.paged_attention import paged_attention_triton

    seqs = 2
    query_lens = [1, 1] if mode != "mixed" else [31, 1]
    seq_len = seq_len or (2048 if mode == "split" else 64)
    tokens = sum(query_lens)
    blocks = -(-seq_len // BLOCK_SIZE)
    cache = torch.zeros(seqs * blocks, BLOCK_SIZE, hk, d, dtype=kv_dtype or dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    paged_attention_triton(
        torch.zeros(tokens, hq, d, dtype=dtype), cache, cache.clone(),
        torch.arange(seqs * blocks, dtype=torch.int32).view(seqs, blocks),
        torch.full((seqs,), seq_len, dtype=torch.int32), starts, d ** -0.5,
        max(query_lens), seq_len, split_kv=mode == "split", sliding_window=4096 if softcap else 0,
        softcap=softcap)


def _small_ops(dtype: torch.dtype, hq: int, hk: int, d: int, hidden: int, inter: int,
               kv_dtype: torch.dtype | None = None) -> None:
    from kernels.activation import silu_and_mul_triton
    from kernels.kv_cache import store_kv_cache_triton
    from kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton
    from kernels.rotary import rotary_embedding_triton

    t = 4
    kv = torch.zeros(t, hk, d, dtype=dtype)
    for cache_dtype in (dtype, FP8):
        cache = torch.zeros(8, BLOCK_SIZE, hk, d, dtype=cache_dtype)
        store_kv_cache_triton(kv, kv.clone(), cache, cache.clone(), torch.arange(t))
    x, w = torch.zeros(t, hidden, dtype=dtype), torch.ones(hidden, dtype=dtype)
    rms_norm_triton(x, w, 1e-6)
    fused_add_rms_norm_triton(x, x.clone(), w, 1e-6)
    qkv = torch.zeros(t, (hq + 2 * hk) * d, dtype=dtype)
    rotary_embedding_triton(torch.arange(t), qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d],
                            torch.zeros(64, d, dtype=torch.float32), d)
    silu_and_mul_triton(torch.zeros(t, 2 * inter, dtype=dtype))
    from kernels.int8_gemm import int8_linear_triton

    q, scale = torch.zeros(inter, hidden, dtype=torch.int8), torch.ones(inter)
    for rows in (t, 100):  # a decode step's rows, a prefill chunk's
        int8_linear_triton(torch.zeros(rows, hidden, dtype=dtype), q, scale, None)
    int8_linear_triton(x, q, scale, torch.zeros(inter, dtype=dtype))  # qkv bias (Qwen2)
    for rows in (t, 100):  # FP8 weights (quantization="fp8" where _scaled_mm does not run)
        int8_linear_triton(torch.zeros(rows, hidden, dtype=dtype), q.to(FP8), scale, None)


MOE_MODELS = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}


def _fused_moe(dtype: torch.dtype, hidden: int, inter: int, experts: int, top_k: int) -> None:
    """The fused MoE's two grouped GEMMs for a decode step's rows and a prefill chunk's; the
    expert weights are one expert's broadcast (the variants depend on dtypes, not sizes)."""
    from kernels.fused_moe import fused_moe_triton

    w13 = torch.zeros(1, 2 * inter, hidden, dtype=dtype).expand(experts, -1, -1)
    w2 = torch.zeros(1, hidden, inter, dtype=dtype).expand(experts, -1, -1)
    for t in (4, 100):
        ids = torch.arange(t * top_k).remainder(experts).view(t, top_k)
        fused_moe_triton(torch.zeros(t, hidden, dtype=dtype), w13, w2,
                         torch.full((t, top_k), 1 / top_k), ids)


def scenarios() -> Iterator[tuple[str, Callable[[], None]]]:
    shapes = {**{f"{m} {hq}/{hk}x{d}": (hq, hk, d) for m, (hq, hk, d) in MODELS.items()},
              **{f"group 4 head {d}": (8, 2, d) for d in HEAD_SIZES},
              **{f"group {g} head 128": (2 * g, 2, 128) for g in range(1, 9)}}
    for dtype in DTYPES:
        for name, (hq, hk, d) in shapes.items():
            for mode in ("decode", "split", "mixed"):
                yield (f"attention {mode} {_TYPES[dtype]} {name}",
                       lambda dt=dtype, a=hq, b=hk, c=d, m=mode: _attention(dt, a, b, c, m))
        for context in (1024, 8192, 131072):  # growing contexts: the same variants
            for mode in ("decode", "split"):
                yield (f"attention {mode} {_TYPES[dtype]} llama-3-8b context {context}",
                       lambda dt=dtype, m=mode, n=context: _attention(dt, 32, 8, 128, m, n))
        for m, (hq, hk, d) in MODELS.items():  # an fp8 KV cache read by each query dtype
            for mode in ("decode", "split", "mixed"):
                yield (f"attention {mode} {_TYPES[dtype]} fp8-kv {m}",
                       lambda dt=dtype, a=hq, b=hk, c=d, m=mode: _attention(dt, a, b, c, m,
                                                                            kv_dtype=FP8))
        for m, (hq, hk, d) in GEMMA_MODELS.items():  # sliding window + soft-capped scores
            for mode in ("decode", "split", "mixed"):
                yield (f"attention {mode} {_TYPES[dtype]} softcap {m}",
                       lambda dt=dtype, a=hq, b=hk, c=d, m=mode: _attention(dt, a, b, c, m,
                                                                            softcap=50.0))
        for m, shape in MOE_MODELS.items():
            yield (f"fused moe {_TYPES[dtype]} {m}",
                   lambda dt=dtype, sh=shape: _fused_moe(dt, *sh))
        for m, hidden, inter in (("llama-3-8b", 4096, 14336), ("qwen2.5-0.5b", 896, 4864)):
            hq, hk, d = MODELS[m]
            yield (f"small ops {_TYPES[dtype]} {m}",
                   lambda dt=dtype, a=hq, b=hk, c=d, h=hidden, i=inter:
                   _small_ops(dt, a, b, c, h, i))


def collect() -> list[dict[str, Any]]:
    """Distinct variants over all scenarios: the first scenario that launches one names it
    (``label``), ``labels`` lists every scenario that launches it."""
    seen: dict[str, dict[str, Any]] = {}
    for label, call in scenarios():
        for kernel, args, kwargs in record(call):
            v = variant(kernel, args, kwargs, label)
            key = json.dumps([v["kernel"], v["signature"], v["constexprs"], v["options"]],
                             sort_keys=True)
            seen.setdefault(key, {**v, "labels": []})["labels"].append(label)
    return list(seen.values())


# ----------------------------------------------------------------------------- compiling
def compile_variant(v: dict[str, Any], target: str) -> dict[str, Any]:
    """Compile one variant for ``target``; its resource use, or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(v["module"]), v["kernel"])
    kernel = kernel.materialize() if hasattr(kernel, "materialize") else kernel
    out = {k: v[k] for k in ("kernel", "label", "labels", "constexprs", "options")}
    out["target"] = target
    out["arg_types"] = sorted({t for t in v["signature"].values() if t.startswith("*")})
    try:
        compiled = triton.compile(ASTSource(kernel, v["signature"], v["constexprs"]),
                                  target=GPUTarget("cuda", TARGETS[target], 32),
                                  options=v["options"])
    except Exception as e:  # reported, and a failure of the test
        out["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        return out
    out.update(resources(compiled.asm["cubin"]))
    out["shared_bytes"] = compiled.metadata.shared
    return out


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and spill (local memory) bytes of a cubin's kernel (cuobjdump)."""
    from triton.backends.nvidia import __file__ as nvidia_init

    tool = os.path.join(os.path.dirname(nvidia_init), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {"registers": int(found.get("REG", -1)), "spill_bytes": int(found.get("LOCAL", 0)),
            "stack_bytes": int(found.get("STACK", 0))}


def runs_on(v: dict[str, Any], target: str) -> bool:
    """fp8 E4M3 tensors need compute capability 8.9+ (Ada, Hopper): Triton rejects them for
    sm_80, and the engine refuses an fp8 KV cache there (``engine/executor/kv_cache_tensor.py``)."""
    return "*fp8e4nv" not in v["signature"].values() or TARGETS[target] >= 89


def _compile_one(job: tuple[dict[str, Any], str]) -> dict[str, Any]:
    return compile_variant(*job)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="sm_90,sm_80")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--list", action="store_true", help="print the variants, compile nothing")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        p.error("unset TRITON_INTERPRET: the interpreter does not compile")
    variants = collect()
    if args.list:
        for v in variants:
            print(json.dumps(v))
        return 0
    jobs = [(v, t) for t in args.targets.split(",") for v in variants if runs_on(v, t)]
    failed = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for res in pool.map(_compile_one, jobs):
            failed += "error" in res
            print(json.dumps(res), flush=True)
    print(json.dumps({"summary": True, "variants": len(variants), "jobs": len(jobs),
                      "compiled": len(jobs) - failed,
                      "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
