"""INT8 linear products (kernels/quant_linear.py): the quantizer's exact values, oneDNN's int8
product against the weight-only reference and the float product, batch invariance, bias and
padding, and the row-bucket warm-up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, quant_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quantize_int8_exact_values():
    w = torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0], [2.0, 1.0, -0.5]])
    q, scale = quant_linear.quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.tolist() == pytest.approx([1 / 127, 1.0, 2 / 127])
    # 0.5 * 127 = 63.5 rounds to even; -1.0 is the row's largest magnitude
    assert q.tolist() == [[64, -127, 32], [0, 0, 0], [127, 64, -32]]


def test_quantize_int8_error_within_half_a_step():
    w = torch.randn(300, 200) * torch.logspace(-3, 0, 300)[:, None]  # rows of every scale
    q, scale = quant_linear.quantize_int8(w)
    assert int(q.abs().max()) == 127
    back = quant_linear.dequantize_int8(q, scale, torch.float32)
    assert ((back - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_weight_only_product(dtype):
    torch.manual_seed(0)
    w, x, b = torch.randn(72, 96), torch.randn(5, 96).to(dtype), torch.randn(72).to(dtype)
    q, scale = quant_linear.quantize_int8(w)
    got = quant_linear.int8_linear_ref(x, q, scale, b)
    assert got.dtype == dtype
    want = F.linear(x.float(), quant_linear.dequantize_int8(q, scale, torch.float32), b.float())
    assert rel_err(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(got, F.linear(x.float(), w, b.float())) < 0.02  # per-channel int8: ~1%


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 96, 72), (3, 200, 300), (17, 64, 130), (300, 96, 40)])
def test_onednn_int8_product_matches_references(dtype, m, k, n):
    torch.manual_seed(m + k + n)
    w, x, b = torch.randn(n, k) * 0.05, torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    q, scale = quant_linear.quantize_int8(w)
    got = quant_linear.int8_linear(x, quant_linear.pack_int8(q, scale), b)
    assert got.shape == (m, n) and got.dtype == dtype
    # activations quantized per row add about as much error again as the weights' int8
    assert rel_err(got, quant_linear.int8_linear_ref(x.float(), q, scale, b.float())) < 0.02
    assert rel_err(got, F.linear(x.float(), w, b.float())) < 0.03


@needs_onednn
def test_onednn_int8_rows_do_not_depend_on_the_batch():
    """int32 sums are exact and each row has its own activation scale, so a row's output is
    the same bits whatever rows share its product and whatever bucket it is padded to."""
    torch.manual_seed(1)
    q, scale = quant_linear.quantize_int8(torch.randn(130, 64))
    w = quant_linear.pack_int8(q, scale)
    x = torch.randn(300, 64)
    full = quant_linear.int8_linear(x, w, None)
    for rows in (slice(0, 1), slice(5, 8), slice(10, 27), slice(0, 260)):
        assert torch.equal(quant_linear.int8_linear(x[rows], w, None), full[rows])
    three = quant_linear.int8_linear(x[:3].reshape(1, 3, 64), w, None)  # leading dims kept
    assert three.shape == (1, 3, 130) and torch.equal(three[0], full[:3])
    assert quant_linear.int8_linear(torch.zeros(2, 64), w, None).abs().max() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_row_quantization_has_the_reference_bits(dtype):
    from kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C kernels")
    torch.manual_seed(2)
    for m, k, pad in [(1, 896, 7), (7, 100, 1), (300, 4864, 20), (3, 5, 0)]:
        x = (torch.randn(m, k) * torch.logspace(-3, 1, m)[:, None]).to(dtype)
        x[0, :4] = torch.tensor([127.0, 0.5, -2.5, 1.5])  # scale 1: halves round to even
        x[-1] = 0 if m > 1 else x[-1]  # an all-zero row: scale 1e-10 / 127, values 128
        got, scale = cpu_kernels.quantize_rows_u8(x, m + pad)
        want, want_scale = quant_linear.quantize_rows(x)
        assert torch.equal(got[:m], want) and torch.equal(scale, want_scale)
        assert got[0, :4].tolist() == [255, 128, 126, 130]
        assert (got[m:] == 128).all()  # padding rows: the zero point
    strided = torch.randn(4, 64).to(dtype)[:, :32]  # rows strided by 64
    assert torch.equal(cpu_kernels.quantize_rows_u8(strided, 8)[0][:4],
                       quant_linear.quantize_rows(strided)[0])


@needs_onednn
def test_warm_up_builds_each_bucket_once_per_shape():
    a = quant_linear.pack_int8(*quant_linear.quantize_int8(torch.randn(40, 32)))
    b = quant_linear.pack_int8(*quant_linear.quantize_int8(torch.randn(40, 32)))
    c = quant_linear.pack_int8(*quant_linear.quantize_int8(torch.randn(24, 32)))
    buckets = len(range(8, cpu_gemm.padded_rows(20) + 1, 8))  # 8, 16, 24
    assert quant_linear.warm_up([a, b, c], torch.float32, 20) == 2 * buckets


def test_packed_gemm_switch_off_keeps_the_reference():
    from kernels import settings

    q, _ = quant_linear.quantize_int8(torch.randn(8, 8))
    previous = settings.current().packed_gemm
    settings.configure(packed_gemm=False)
    try:
        assert not quant_linear.cpu_supported(q)
    finally:
        settings.configure(packed_gemm=previous)
    assert quant_linear.cpu_supported(q) == (previous and torch.backends.mkldnn.is_available())
