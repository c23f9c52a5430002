"""Weight-only int8 or FP8 matmul for GPUs (W8A16): x [M, K] (bfloat16, float16 or float32)
times an int8 or FP8 E4M3 weight [N, K] (E4M3 on compute capability 8.9+ only) with one
float32 scale per output channel, the scale (and bias) applied once in the epilogue, the weight
tile converted to x's dtype in registers. Decoding reads each weight once per step, so 8-bit
weights halve the bytes a decode step moves against bfloat16.

Tiles: 16 rows for decode-sized M (few rows, wide weights), 64 above; 64 output channels and
128 inputs per step. Split-K is not done: at 1-16 rows the N/64 programs of a 4096-wide or wider
layer already cover a GPU's SMs. The torch reference is ``quant_linear.int8_linear_ref``.
"""

from __future__ import annotations

import torch

from kernels._triton import cdiv, interpreting, tl, triton


@triton.jit(do_not_specialize=["m"])
def _w8a16_kernel(
    out_ptr,  # [M, N] x's dtype, rows strided by stride_om
    x_ptr,  # [M, K] rows strided by stride_xm, last dim contiguous
    w_ptr,  # [N, K] int8 or fp8 e4m3, rows strided by stride_wn, last dim contiguous
    scale_ptr,  # [N] float32
    bias_ptr,  # [N] x's dtype (unused without HAS_BIAS)
    m, n, k,
    stride_om, stride_xm, stride_wn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,  # the interpreter: float32 products (its bf16 arithmetic is wrong)
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < m, cols < n
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ (q [N, K] int8 or fp8 e4m3 * scale [N])^T (+ bias) -> [..., N] in x's
    dtype."""
    if x.dim() != 2:
        return int8_linear_triton(x.reshape(-1, x.shape[-1]), q, scale, bias).view(
            *x.shape[:-1], -1)
    if q.dtype not in (torch.int8, torch.float8_e4m3fn) or q.dim() != 2 or q.shape[1] != x.shape[1]:
        raise ValueError(f"q must be int8 or fp8 e4m3 [N, {x.shape[1]}], got {q.dtype} "
                         f"{tuple(q.shape)}")
    if scale.shape != (q.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 [{q.shape[0]}], got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if x.stride(1) != 1 or q.stride(1) != 1:
        raise ValueError("x and q must be contiguous in their last dim")
    m, (n, k) = x.shape[0], q.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    grid = (cdiv(m, block_m), cdiv(n, 64))
    _w8a16_kernel[grid](
        out, x, q, scale, x if bias is None else bias, m, n, k,
        out.stride(0), x.stride(0), q.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128,
        FP32_DOT=x.dtype == torch.float32 or interpreting(), num_warps=4,
    )
    return out
