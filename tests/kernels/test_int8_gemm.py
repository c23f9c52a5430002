"""The Triton weight-only int8 matmul (kernels/int8_gemm.py) against the torch reference
(``quant_linear.int8_linear_ref``) on irregular shapes: rows of a decode step and of a prefill
chunk, widths that are not multiples of the tiles, with and without bias, every dtype."""

from __future__ import annotations

import pytest
import torch

from kernels import ops, settings
from kernels.int8_gemm import int8_linear_triton
from kernels.quant_linear import int8_linear_ref, quantize_int8
from tests.kernels.kernel_testing import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 72, 96), (5, 130, 200), (17, 64, 128), (70, 40, 72)])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_reference(device, dtype, m, n, k, bias):
    q, scale = quantize_int8(torch.randn(n, k) * 0.05)
    q, scale = q.to(device), scale.to(device)
    x = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    got = int8_linear_triton(x, q, scale, b)
    assert got.shape == (m, n) and got.dtype == dtype
    want = int8_linear_ref(x.float(), q, scale, None if b is None else b.float())
    assert_close(got, want.to(dtype))  # float32 sums, rounded once


def test_leading_dims_and_ops_dispatch(device):
    q, scale = quantize_int8(torch.randn(48, 32))
    q, scale = q.to(device), scale.to(device)
    x = torch.randn(2, 3, 32, device=device)
    got = int8_linear_triton(x, q, scale, None)
    assert got.shape == (2, 3, 48)
    assert_close(got, int8_linear_ref(x, q, scale, None))
    with settings.backend("triton"):
        assert_close(ops.int8_linear(x, q, scale, None), got)


def test_bad_arguments_are_refused(device):
    q, scale = quantize_int8(torch.randn(8, 16))
    x = torch.randn(2, 16, device=device)
    with pytest.raises(ValueError, match="int8"):
        int8_linear_triton(x, q.float().to(device), scale.to(device), None)
    with pytest.raises(ValueError, match="scale"):
        int8_linear_triton(x, q.to(device), scale[:4].to(device), None)
