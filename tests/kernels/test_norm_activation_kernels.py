"""Triton RMSNorm, fused add + RMSNorm and SiLU-and-mul against their references."""

from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from kernels.rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from tests.kernels.kernel_testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 64), (7, 200), (33, 1000), (3, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(device, shape, dtype):
    x = torch.randn(shape).to(dtype).to(device)
    weight = torch.randn(shape[1]).to(dtype).to(device)
    assert_close(rms_norm_triton(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(device, shape, dtype):
    x = torch.randn(shape).to(dtype).to(device)
    residual = torch.randn(shape).to(dtype).to(device)
    weight = torch.randn(shape[1]).to(dtype).to(device)
    ref_residual = residual.clone()
    out, new_residual = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    ref_out, _ = fused_add_rms_norm_ref(x, ref_residual, weight, 1e-6)
    assert new_residual is residual
    assert_close(residual, ref_residual)
    assert_close(out, ref_out)


def test_rms_norm_strided_rows(device):
    base = torch.randn(9, 300, device=device)
    x = base[:, :200]  # rows 300 apart, last dim contiguous
    weight = torch.randn(200, device=device)
    assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (5, 300), (17, 1500)])  # 1500 > one column block
def test_silu_and_mul(device, shape, dtype):
    x = (torch.randn(shape[0], 2 * shape[1]) * 3).to(dtype).to(device)
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x))


def test_launchers_reject_bad_shapes(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(8, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm_triton(x, torch.ones(4, 16, dtype=torch.float16, device=device), torch.ones(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm_triton(x.t(), torch.ones(4, device=device), 1e-6)
    with pytest.raises(ValueError, match=r"2\*I"):
        silu_and_mul_triton(torch.randn(4, 7, device=device))


def test_empty_batch(device):
    x = torch.randn(0, 32, device=device)
    assert rms_norm_triton(x, torch.ones(32, device=device), 1e-6).shape == (0, 32)
    assert silu_and_mul_triton(x).shape == (0, 16)
