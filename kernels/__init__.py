"""Fused kernels for the engine's layers; the engine calls `kernels.ops` (and `cpu_gemm` for its
matmuls on the CPU).

| file | what |
|---|---|
| `ops.py` | entry points and the backend switch ("auto": Triton on CUDA, C kernels or references on CPU) |
| `cpu_kernels.py` | builds, loads (ctypes) and calls the C kernels of `csrc/` for CPU tensors |
| `csrc/` | C: paged attention, RMSNorm, SiLU-and-mul, rotary, KV store, int8 and dense linear layers (AVX-512/AVX2 paths, OpenMP) |
| `cpu_gemm.py` | linear layers on the CPU with weights prepacked once (the C dense kernel, or oneDNN) |
| `rms_norm.py` | RMSNorm and fused residual-add + RMSNorm (residual updated in place) |
| `activation.py` | SiLU-and-multiply |
| `rotary.py` | rotary embedding of q and k in place from the cos/sin cache |
| `kv_cache.py` | KV-cache store through the slot mapping (-1 = skip) |
| `paged_attention.py` | paged attention for mixed prefill/decode batches (one launch) |
| `paged_attention_split.py` | split-KV (flash-decoding) variant + reduce for long decodes |
| `attention_tile.py` | the online-softmax loop both attention kernels share |
| `_triton.py` | lazy Triton import (kernels import, and run their references, without it) |

Each Triton kernel file holds the `@triton.jit` kernel, its checking launcher (`*_triton`) and
the pure-torch reference (`*_ref`); the C kernels follow the references' contracts. Tests: `tests/kernels` (CPU via `TRITON_INTERPRET=1`, CUDA with
`-m gpu`); benchmarks: `load_tests/kernel_bench.py`.
"""
