"""Fused kernels for the engine's layers. The engine enters through one door: `kernels.ops` for
every computation and `kernels.settings` for every switch and the machine's facts it reads.

| file | what |
|---|---|
| `ops.py` | the entry points: norms, activation, rotary, MoE here; the rest from `ops_*.py` |
| `ops_attention.py`, `ops_sampling.py`, `ops_linear.py` | attention; the sampler's row kernels; the linear layers' products and weight forms |
| `settings.py` | the one switch board: the backend ("auto": Triton on CUDA, C kernels or references on CPU), the CPU kernels' switches, the ISA cap, and the facts read under them |
| `cpu_isa.py` | the CPU's instruction-set class from its flags, and what follows from a class |
| `cpu_kernels.py` | builds and loads (ctypes) the C kernels of `csrc/` |
| `cpu_launchers.py` | each C kernel's check of the tensors it takes, and its call |
| `quant_linear.py`, `fp8_linear.py`, `int8_gemm.py` | int8 and FP8 weights: quantizers, references, the CPU int8 kernel's layout, the Triton W8A16 kernel |
| `csrc/` | C: paged attention, RMSNorm, SiLU-and-mul, rotary, KV store, int8 and dense linear layers (AVX-512/AVX2 paths, OpenMP) |
| `cpu_gemm.py` | linear layers on the CPU with weights prepacked once (the C dense kernel, or oneDNN) |
| `fused_moe.py` | the top-k experts' gated MLPs: Triton grouped GEMM, `grouped_mm` on the CPU, the reference |
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
