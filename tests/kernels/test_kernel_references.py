"""The pure-torch references (the CPU fallback and the kernels' yardstick) against naive
formulas, and ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import ops, settings
from kernels.activation import silu_and_mul_ref
from kernels.kv_cache import store_kv_cache_ref
from kernels.paged_attention import paged_attention_ref
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotary_embedding_ref
from tests.kernels.kernel_testing import build_paged_batch


def naive_attention(query, dense_k, dense_v, seq_lens, query_lens, scale, window=0, softcap=0.0):
    """Dense causal GQA attention in float64, one (token, head) at a time; ``window`` > 0: the
    last that many positions only; ``softcap`` > 0: scores capped to c * tanh(s / c)."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    num_q_heads, num_kv_heads = query.shape[1], dense_k[0].shape[1]
    row = 0
    for k, v, seq_len, q_len in zip(dense_k, dense_v, seq_lens, query_lens, strict=True):
        for i in range(q_len):
            pos = seq_len - q_len + i
            for h in range(num_q_heads):
                kh = h // (num_q_heads // num_kv_heads)
                first = max(0, pos + 1 - window) if window else 0
                scores = k[first : pos + 1, kh].double() @ query[row, h].double() * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[row, h] = torch.softmax(scores, 0) @ v[first : pos + 1, kh].double()
            row += 1
    return out


@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        ([37, 5, 16, 50, 70], [37, 1, 4, 1, 9]),  # mixed: prefill, decode, cached-prefix chunks
        ([9, 33, 1], [1, 1, 1]),  # decode-only batch (one padded gather)
        ([17], [17]),  # single full prefill
    ],
)
@pytest.mark.parametrize("heads", [(8, 2), (5, 1), (4, 4)])
def test_paged_attention_ref_matches_dense_causal(seq_lens, query_lens, heads):
    batch = build_paged_batch(seq_lens, query_lens, *heads, head_size=16, block_size=8, dtype=torch.float32)
    scale = 0.25
    out = paged_attention_ref(*batch.attention_args(scale))
    expected = naive_attention(batch.query, batch.dense_k, batch.dense_v, seq_lens, query_lens, scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(1, 0.0), (6, 0.0), (13, 2.0), (0, 2.0)])
@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [([37, 5, 16, 50, 70], [37, 1, 4, 1, 9]), ([9, 33, 1], [1, 1, 1]), ([17], [17])],
)
def test_paged_attention_ref_sliding_window_and_softcap(seq_lens, query_lens, window, softcap):
    batch = build_paged_batch(seq_lens, query_lens, 8, 2, head_size=16, block_size=8,
                              dtype=torch.float32)
    out = paged_attention_ref(*batch.attention_args(0.25), window, softcap)
    expected = naive_attention(batch.query, batch.dense_k, batch.dense_v, seq_lens, query_lens,
                               0.25, window, softcap)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_ref_zero_rows_outside_sequences():
    batch = build_paged_batch([6, 4], [3, 1], 2, 1, head_size=8, block_size=8, dtype=torch.float32)
    padded = torch.cat([batch.query, torch.randn(2, 2, 8)])  # two padding tokens at the end
    args = list(batch.attention_args(1.0))
    args[0] = padded
    out = paged_attention_ref(*args)
    assert torch.equal(out[4:], torch.zeros(2, 2, 8))


def test_store_kv_cache_ref_writes_slots_and_skips_padding():
    kv = torch.zeros(4, 2, 4, 1, 2)  # 4 blocks of 4 slots
    key = torch.arange(1.0, 7.0).view(3, 1, 2)
    value = -key
    store_kv_cache_ref(key, value, kv[:, 0], kv[:, 1], torch.tensor([5, -1, 12]))
    written = kv[:, 0, :, 0, 0].flatten().nonzero().flatten().tolist()
    assert written == [5, 12]
    assert kv[1, 0, 1, 0].tolist() == [1.0, 2.0]
    assert kv[3, 1, 0, 0].tolist() == [-5.0, -6.0]


def test_rms_norm_ref_matches_formula():
    x = torch.tensor([[3.0, 4.0], [1.0, -1.0]])
    out = rms_norm_ref(x, torch.tensor([1.0, 2.0]), eps=0.0)
    rms = torch.tensor([[12.5**0.5], [1.0]])
    torch.testing.assert_close(out, x / rms * torch.tensor([1.0, 2.0]))


def test_fused_add_rms_norm_ref_updates_residual_in_place():
    x = torch.randn(5, 12, dtype=torch.float16)
    residual = torch.randn(5, 12, dtype=torch.float16)
    expected_residual = x + residual
    weight = torch.randn(12, dtype=torch.float16)
    out, new_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert new_residual is residual
    assert torch.equal(residual, expected_residual)
    assert torch.equal(out, rms_norm_ref(expected_residual, weight, 1e-6))


def test_silu_and_mul_ref_matches_formula():
    x = torch.randn(3, 10, dtype=torch.float64)
    expected = x[:, :5] * torch.sigmoid(x[:, :5]) * x[:, 5:]
    torch.testing.assert_close(silu_and_mul_ref(x), expected)


def test_rotary_ref_matches_hf_rotate_half():
    head_size, positions = 8, torch.tensor([0, 3, 7])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.outer(torch.arange(10).float(), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    query, key = torch.randn(3, 2 * head_size), torch.randn(3, head_size)
    q_expected, k_expected = query.clone(), key.clone()
    rotary_embedding_ref(positions, query, key, cache, head_size)
    emb = torch.cat([freqs, freqs], dim=-1)[positions][:, None]  # HF: cos/sin over the full dim

    def rotate_half(t):
        return torch.cat([-t[..., head_size // 2 :], t[..., : head_size // 2]], dim=-1)

    for got, x in ((query, q_expected), (key, k_expected)):
        x = x.view(3, -1, head_size)
        hf = x * emb.cos() + rotate_half(x) * emb.sin()
        torch.testing.assert_close(got.view(3, -1, head_size), hf)
    assert torch.equal(query[0], q_expected[0])  # position 0 is the identity


def test_backend_switch_validates_and_restores():
    assert settings.current().backend == "auto"
    with pytest.raises(ValueError, match="backend"):
        settings.configure(backend="cuda")
    with settings.backend("reference"):
        assert settings.current().backend == "reference"
        x = torch.randn(2, 8)
        assert torch.equal(ops.silu_and_mul(x), silu_and_mul_ref(x))
    assert settings.current().backend == "auto"


def test_auto_backend_never_calls_triton_on_cpu(monkeypatch):
    """'auto' runs CPU tensors on the C kernels (tests/kernels/test_cpu_kernels.py) or the
    references, never on Triton."""
    def fail(*args, **kwargs):
        raise AssertionError("Triton kernel called for a CPU tensor under 'auto'")

    from kernels import activation, rms_norm

    monkeypatch.setattr(rms_norm, "rms_norm_triton", fail)
    monkeypatch.setattr(activation, "silu_and_mul_triton", fail)
    x = torch.randn(3, 8)
    torch.testing.assert_close(ops.rms_norm(x, torch.ones(8), 1e-6),
                               rms_norm_ref(x, torch.ones(8), 1e-6))
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :4]) * x[:, 4:])


def test_ops_work_without_triton():
    """CPU installs may lack Triton: kernels.ops must import and run the references."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from kernels import ops, settings\n"
        "from kernels._triton import HAS_TRITON\n"
        "assert not HAS_TRITON\n"
        "x = torch.randn(3, 8)\n"
        "assert ops.rms_norm(x, torch.ones(8), 1e-6).shape == (3, 8)\n"
        "with settings.backend('triton'):\n"
        "    try:\n"
        "        ops.silu_and_mul(x)\n"
        "    except RuntimeError as e:\n"
        "        assert 'not installed' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('expected RuntimeError')\n"
        "assert 'triton' not in {m for m in sys.modules if sys.modules[m] is not None}\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)


def test_importing_ops_does_not_import_triton():
    code = "import sys\nimport kernels.ops\nassert 'triton' not in sys.modules, 'triton imported eagerly'\n"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=120)
