"""Fused mixture-of-experts MLP: each token's hidden state through its top-k experts' gated MLPs
(``silu(x @ gate^T) * (x @ up^T) @ down^T``), weighted by its routing weights and summed.

The weights of all experts are stacked: ``w13`` [E, 2*I, H] (gate rows, then up rows) and ``w2``
[E, H, I]. Rows are grouped by expert so that each projection is one grouped GEMM over all
experts rather than a matmul per token:

- ``align_by_expert`` sorts the T*K (token, choice) pairs by expert and pads each expert's group
  to a multiple of ``BLOCK_M`` rows, so every row block of the grouped GEMM is one expert's. It
  runs on the device without a host synchronisation (the block count is an upper bound; blocks
  past the last group carry expert -1 and do nothing).
- ``_fused_moe_kernel`` (Triton) multiplies one block of sorted rows by its expert's weight:
  for gate/up it gathers the rows of ``x`` (pair // K), for down it reads the activation rows of
  the pairs and scales them by their routing weight. The K weighted rows of a token are then
  summed in torch.

On the CPU ``fused_moe_cpu`` runs ``torch._grouped_mm`` over the expert-sorted rows.
``load_tests/moe_bench.py`` on a 2-core AMD EPYC with AVX512-BF16 (torch 2.13; H=1024, I=3584,
E=8, top-2; fastest of 8-10 calls, in the least loaded runs), ms for 4 / 64 / 512 tokens:

    float32:  grouped_mm 24.2 / 53.4 / 176   loop 24.5 / 58.2 / 176   bmm 42.0 / 56.1 / 189
    bfloat16: grouped_mm  9.3 / 24.2 / 79.4  loop  7.1 / 24.2 / 82.0  bmm 17.3 / 25.7 / 89.0

(loop: index_select + mm per expert, ``fused_moe_ref``; bmm: groups padded to the largest).
grouped_mm ties the loop, without its Python loop and host sync, and beats bmm at decode sizes
(with other processes loading the cores, bmm led at 512 tokens in float32). The loop stays as
the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import cdiv, interpreting, tl, triton


def check_moe_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """``ValueError`` unless x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, K]."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(f"expert weights do not match x [T, {x.shape[1]}]: w13 "
                         f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must be [T, K] with T={x.shape[0]}, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The plain reference: per expert, its rows gathered, two matmuls, weighted, added back.
    x [T, H] -> [T, H] in x's dtype (the routing weights multiply in x's dtype)."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1)
    for e in torch.unique(flat_ids).tolist():
        pairs = (flat_ids == e).nonzero().squeeze(1)
        tokens = pairs // topk_ids.shape[1]
        h = x.index_select(0, tokens) @ w13[e].t()
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = (h @ w2[e].t()) * topk_weights.reshape(-1)[pairs, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The T*K pairs ordered by expert (stable) and each expert's row count [E] (int64).
    Counted with scatter_add: bincount on CUDA reads its input's max on the host, which a
    CUDA graph capture cannot take."""
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return torch.argsort(flat, stable=True), counts.scatter_add_(0, flat, torch.ones_like(flat))


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` over the expert-sorted rows (offsets: the groups' ends)."""
    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    t, k = topk_ids.shape
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    rows = x.index_select(0, order // k)
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
    h = F.silu(h[:, : w2.shape[2]]) * h[:, w2.shape[2]:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, y)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    return hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted_ids`` [num_blocks * block_m] int32: the pair indices (token * K + choice) grouped
    by expert, each group padded to a multiple of ``block_m`` with T*K (no pair); and
    ``block_expert`` [num_blocks] int32: each row block's expert, -1 past the last group.
    ``num_blocks`` = cdiv(T*K, block_m) + E bounds the padded length without a host sync."""
    num_pairs = topk_ids.numel()
    order, counts = sort_by_expert(topk_ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    start, padded_start = counts.cumsum(0) - counts, padded_end - padded
    experts = topk_ids.reshape(-1)[order]
    dest = padded_start[experts] + torch.arange(num_pairs, device=order.device) - start[experts]
    num_blocks = cdiv(num_pairs, block_m) + num_experts
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32,
                            device=order.device)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=order.device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_ids, block_expert.to(torch.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _fused_moe_kernel(
    out_ptr,  # [T*K, N] x's dtype: row p is pair p's product
    a_ptr,  # [R, Kd] rows strided by stride_am, last dim contiguous (x, or the activations)
    w_ptr,  # [E, N, Kd] the stacked expert weights, contiguous in their last dim
    topk_weights_ptr,  # [T*K] float32 routing weights (read with MUL_WEIGHT only)
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32 pair indices by expert, T*K = padding
    block_expert_ptr,  # [num_blocks] int32 the expert of each row block, -1: none
    num_pairs, n, kd,  # T*K; output and reduction widths
    stride_am, stride_we, stride_wn, stride_om,
    A_ROW_DIV: tl.constexpr,  # row of a for pair p: p // A_ROW_DIV (K for x, 1 for activations)
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,  # the interpreter: float32 products (its bf16 arithmetic is wrong)
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert < 0:
        return
    pairs = tl.load(sorted_ids_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    w_cols = (w_ptr + expert.to(tl.int64) * stride_we
              + cols.to(tl.int64)[None, :] * stride_wn)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, kd, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < kd
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor,
                  sorted_ids: torch.Tensor, block_expert: torch.Tensor, row_div: int,
                  mul_weight: bool, block_m: int) -> None:
    n, kd = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], cdiv(n, 64))
    _fused_moe_kernel[grid](
        out, a, w, topk_weights, sorted_ids, block_expert, out.shape[0], n, kd,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=row_div, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
        FP32_DOT=a.dtype == torch.float32 or interpreting(), num_warps=4,
    )


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The grouped-GEMM kernel for gate/up, SiLU-and-multiply, the kernel for down (rows
    weighted), each token's K rows summed: x [T, H] -> [T, H] in x's dtype."""
    from kernels.activation import silu_and_mul_triton

    check_moe_args(x, w13, w2, topk_weights, topk_ids)
    if x.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("x, w13 and w2 must be contiguous in their last dim")
    t, k = topk_ids.shape
    if t == 0:
        return torch.zeros_like(x)
    block_m = 16 if t * k <= 64 else 64
    sorted_ids, block_expert = align_by_expert(topk_ids, w13.shape[0], block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    h = torch.empty((t * k, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, weights, sorted_ids, block_expert, k, False, block_m)
    act = silu_and_mul_triton(h)
    y = torch.empty((t * k, w2.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, weights, sorted_ids, block_expert, 1, True, block_m)
    return y.view(t, k, -1).sum(1)
