"""FP8 E4M3 weights: the per-channel quantizer, the weight-only reference, the W8A8 product
through ``torch._scaled_mm`` (the GPU path; torch runs it on the CPU too) and the Triton W8A16
kernel with FP8 weights, on irregular shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import ops
from kernels.fp8_linear import (
    FP8,
    fp8_linear_ref,
    fp8_linear_scaled,
    quantize_fp8,
    quantize_rows_fp8,
)
from kernels.int8_gemm import int8_linear_triton


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.view(-1, 1)


def test_quantizer_maps_each_channels_largest_value_to_448():
    torch.manual_seed(0)
    w = torch.randn(40, 72) * torch.logspace(-3, 2, 40)[:, None]
    w[7] = 0.0
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (40,)
    assert scale[7] == 1.0 and not q[7].float().any()
    rows = [i for i in range(40) if i != 7]
    assert torch.equal(q[rows].float().abs().amax(1), torch.full((39,), 448.0))
    torch.testing.assert_close(scale[rows], w[rows].abs().amax(1) / 448)
    # 3 mantissa bits: each normal value within half a step (1/16) of itself
    back, big = _dequant(q, scale), w.abs() > scale[:, None] * 2**-6
    assert ((back - w).abs()[big] <= w.abs()[big] / 16 + 1e-12).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_weight_only_reference_is_the_dequantized_product(dtype, rows):
    torch.manual_seed(rows)
    w, x, bias = torch.randn(48, 80), torch.randn(rows, 80).to(dtype), torch.randn(48).to(dtype)
    q, scale = quantize_fp8(w)
    got = fp8_linear_ref(x, q, scale, bias)
    want = F.linear(x.float(), _dequant(q, scale), bias.float())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol * 10, rtol=tol)
    # against the unquantized weight: within fp8's rounding (about 2% of a product's size)
    exact = F.linear(x.float(), w, bias.float())
    assert (got.float() - exact).norm() / exact.norm() < 0.05


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_scaled_mm_product_quantizes_rows_and_scales_back(rows):
    """The W8A8 path the GPU runs (``torch._scaled_mm``), here on the CPU: equal to the float
    product of the per-row quantized activations and the quantized weight."""
    torch.manual_seed(rows)
    w, x = torch.randn(64, 96), (torch.randn(rows, 96) * torch.logspace(-2, 1, rows)[:, None])
    bias = torch.randn(64).bfloat16()
    q, scale = quantize_fp8(w)
    xq, row_scale = quantize_rows_fp8(x)
    assert torch.equal(xq.float().abs().amax(1), torch.full((rows,), 448.0))
    torch.testing.assert_close(xq.float() * row_scale, x, atol=1e-6, rtol=1 / 16)
    got = fp8_linear_scaled(x.bfloat16().view(1, rows, 96), q, scale, bias)
    assert got.shape == (1, rows, 64) and got.dtype == torch.bfloat16
    xq_b, row_scale_b = quantize_rows_fp8(x.bfloat16())  # what the product quantizes
    xb = xq_b.float() * row_scale_b
    want = F.linear(xb, _dequant(q, scale), bias.float())
    torch.testing.assert_close(got[0].float(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 70, 130), (9, 64, 256), (40, 33, 96)])
def test_triton_w8a16_takes_fp8_weights(device, dtype, m, n, k):
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("E4M3 needs compute capability 8.9+")
    torch.manual_seed(m + n)
    q, scale = quantize_fp8(torch.randn(n, k))
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    got = int8_linear_triton(x.to(device), q.to(device), scale.to(device), bias.to(device))
    want = fp8_linear_ref(x, q, scale, bias)
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol * 10, rtol=tol)


def test_ops_runs_the_reference_on_the_cpu():
    torch.manual_seed(1)
    q, scale = quantize_fp8(torch.randn(32, 48))
    x = torch.randn(3, 48)
    assert torch.equal(ops.fp8_linear(x, q, scale, None), fp8_linear_ref(x, q, scale, None))
