"""INT8 linear products (kernels/quant_linear.py): the quantizer's exact values, the packed
layout, the C kernel's product (``csrc/int8_linear_cpu.c``) bit for bit against its torch
arithmetic and close to the weight-only reference and the float product, batch invariance,
bias, strided rows. ``test_cpu_isa.py`` runs the product tests for every class the CPU has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_kernels, quant_linear


def needs_c_kernels() -> None:
    if not cpu_kernels.available():
        pytest.skip("no C kernels")


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


def test_pack_layout_and_its_inverse():
    q = torch.arange(-60, 60, dtype=torch.int8).view(20, 6)  # 20 channels, 6 inputs: both padded
    w = quant_linear.pack_int8(q, torch.ones(20))
    assert w.weight.numel() == 32 * 8 and (w.n, w.k) == (20, 6)
    # block 0, group 0: channel c's inputs 0..3 at bytes 4c..4c+3
    assert w.weight[:8].tolist() == q[0, :4].tolist() + q[1, :4].tolist()
    # block 0, group 1: inputs 4, 5 then two zeros
    assert w.weight[64:68].tolist() == [q[0, 4], q[0, 5], 0, 0]
    assert w.weight[128:136].tolist() == q[16, :4].tolist() + q[17, :4].tolist()  # block 1
    assert torch.equal(quant_linear.unpack_int8(w), q)
    assert w.colsum.tolist() == q.long().sum(1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 96, 72), (3, 200, 300), (17, 64, 130), (300, 96, 40),
                                   (9, 4864, 37), (6, 13, 16), (2, 3, 5)])
def test_c_int8_product_is_its_torch_arithmetic(dtype, m, k, n):
    """Every tile shape (rows 1-6, 1-4 column blocks, edges), inputs not a multiple of 4, the
    bias: the same bits as the torch arithmetic; close to the weight-only and float products."""
    needs_c_kernels()
    torch.manual_seed(m + k + n)
    w, x, b = torch.randn(n, k) * 0.05, torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
    x[0, :4] = torch.tensor([1.0, 0.5 / 127, -2.5 / 127, 1.5 / 127])[:k]  # halves round to even
    q, scale = quant_linear.quantize_int8(w)
    packed = quant_linear.pack_int8(q, scale)
    for bias in (b, None):
        got = quant_linear.int8_linear(x, packed, bias)
        assert got.shape == (m, n) and got.dtype == dtype
        assert torch.equal(got, quant_linear.int8_linear_dynamic_ref(x, q, scale, bias))
    # activations quantized per row add about as much error again as the weights' int8
    got = quant_linear.int8_linear(x, packed, b)
    assert rel_err(got, quant_linear.int8_linear_ref(x.float(), q, scale, b.float())) < 0.02
    assert rel_err(got, F.linear(x.float(), w, b.float())) < 0.03


def test_c_int8_rows_do_not_depend_on_the_batch():
    """int32 sums are exact and each row has its own activation scale, so a row's output is
    the same bits whatever rows share its product and whichever tile it lands in."""
    needs_c_kernels()
    torch.manual_seed(1)
    q, scale = quant_linear.quantize_int8(torch.randn(130, 64))
    w = quant_linear.pack_int8(q, scale)
    x = torch.randn(300, 64)
    full = quant_linear.int8_linear(x, w, None)
    for rows in (slice(0, 1), slice(5, 8), slice(10, 27), slice(0, 260)):
        assert torch.equal(quant_linear.int8_linear(x[rows], w, None), full[rows])
    three = quant_linear.int8_linear(x[:3].reshape(1, 3, 64), w, None)  # leading dims kept
    assert three.shape == (1, 3, 130) and torch.equal(three[0], full[:3])
    strided = torch.randn(4, 128)[:, :64]  # rows 128 apart
    assert torch.equal(quant_linear.int8_linear(strided, w, None),
                       quant_linear.int8_linear(strided.contiguous(), w, None))
    assert quant_linear.int8_linear(torch.zeros(2, 64), w, None).abs().max() == 0
    assert quant_linear.int8_linear(torch.zeros(0, 64), w, None).shape == (0, 130)


def test_packed_gemm_switch_off_keeps_the_reference():
    from kernels import settings

    q, _ = quant_linear.quantize_int8(torch.randn(8, 8))
    previous = settings.current().packed_gemm
    settings.configure(packed_gemm=False)
    try:
        assert not quant_linear.cpu_supported(q)
    finally:
        settings.configure(packed_gemm=previous)
    assert quant_linear.cpu_supported(q) == (previous and cpu_kernels.available())
