"""The C kernels for the CPU (kernels/csrc, through kernels.cpu_kernels) against the torch
references and exact formulas; the prepacked oneDNN linear against F.linear; the fallbacks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_kernels, ops, settings
from kernels import cpu_launchers as cpu
from kernels.activation import silu_and_mul_ref
from kernels.kv_cache import store_kv_cache_ref
from kernels.paged_attention import paged_attention_ref
from kernels.rms_norm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.rotary import rotary_embedding_ref
from tests.kernels.kernel_testing import build_paged_batch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                                reason="no C compiler: the CPU kernels fall back to torch")
# Against the float64-accurate torch references: float32 to rounding, bfloat16 to its
# rounding plus the bfloat16 softmax weights of the decode path's value product.
TOL = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2)}


def test_library_builds_and_loads():
    assert cpu_kernels.available()
    path = cpu_kernels.build()
    assert path.exists() and path.parent.parent.name == "kernels"
    assert path == cpu_kernels.library_path()  # cached: a second build is the same file


def _attention(batch, scale, dtype):
    k, v = batch.k_cache.contiguous(), batch.v_cache.contiguous()  # the engine's layout
    args = (batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    assert cpu.supports_attention(*args)
    got = cpu.paged_attention(*args, scale)
    expected = paged_attention_ref(*args, scale, batch.max_query_len, batch.max_seq_len)
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_size", [((14, 2), 64), ((8, 2), 128), ((4, 4), 64),
                                             ((6, 2), 32), ((4, 1), 80), ((16, 1), 64),
                                             ((12, 1), 128)])
@pytest.mark.parametrize("block_size", [8, 16, 32, 128])
def test_paged_attention_matches_reference(dtype, heads, head_size, block_size):
    # prefill from scratch, prefill chunks after a cached prefix, decode rows (short and long)
    seq_lens, query_lens = [37, 5, 70, 200, 1, 130], [37, 1, 9, 1, 1, 24]
    torch.manual_seed(block_size + head_size)
    batch = build_paged_batch(seq_lens, query_lens, *heads, head_size=head_size,
                              block_size=block_size, dtype=dtype)
    got, expected = _attention(batch, head_size**-0.5, dtype)
    assert got.dtype == dtype and got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])


def test_paged_attention_decode_only_and_padding_rows():
    batch = build_paged_batch([300, 17, 64], [1, 1, 1], 14, 2, head_size=64, block_size=16,
                              dtype=torch.bfloat16)
    got, expected = _attention(batch, 0.125, torch.bfloat16)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[torch.bfloat16])
    query = torch.cat([batch.query, torch.randn(3, 14, 64).bfloat16()])  # 3 rows past the batch
    out = cpu.paged_attention(query, batch.k_cache.contiguous(), batch.v_cache.contiguous(),
                              batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125)
    assert torch.equal(out[:3], got) and not out[3:].any()


@pytest.mark.parametrize("heads,head_size", [((14, 2), 64), ((8, 2), 128), ((4, 4), 64),
                                             ((3, 3), 64), ((6, 2), 32)])
def test_paged_attention_kv_heads_alone_give_the_same_bits(heads, head_size):
    """Each kv head's output is its own: the batch run with one kv head (and its group of
    query heads) at a time gives the same bits. On AMX the decode rows' kv heads share tiles
    (two of a group of 7, up to four of 64 dims), the prompt rows' do not."""
    hq, hk = heads
    group = hq // hk
    batch = build_paged_batch([300, 17, 64, 45], [1, 1, 1, 30], hq, hk, head_size=head_size,
                              block_size=16, dtype=torch.bfloat16)
    k, v = batch.k_cache.contiguous(), batch.v_cache.contiguous()
    rest = (batch.block_tables, batch.seq_lens, batch.query_start_loc, 0.125)
    got = cpu.paged_attention(batch.query, k, v, *rest)
    for h in range(hk):
        q_h = batch.query[:, h * group:(h + 1) * group].contiguous()
        alone = cpu.paged_attention(q_h, k[:, :, h:h + 1].contiguous(),
                                    v[:, :, h:h + 1].contiguous(), *rest)
        assert torch.equal(alone, got[:, h * group:(h + 1) * group])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_ignores_cache_outside_the_sequence(dtype):
    """Keys past a sequence's length (stale data, even NaN) never reach its output."""
    batch = build_paged_batch([20, 9], [1, 9], 4, 2, head_size=64, block_size=16, dtype=dtype)
    k, v = batch.k_cache.contiguous(), batch.v_cache.contiguous()
    args = (batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    before = cpu.paged_attention(*args, 0.125)
    for b, n in enumerate(batch.seq_lens.tolist()):  # poison each last block's unused slots
        last = int(batch.block_tables[b, (n - 1) // 16])
        k[last, n % 16 or 16 :] = float("nan")
        v[last, n % 16 or 16 :] = float("nan")
    assert torch.equal(cpu.paged_attention(*args, 0.125), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_size", [((14, 2), 64), ((8, 2), 128), ((4, 1), 80),
                                             ((4, 2), 36)])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (19, 3.0), (40, 0.0), (0, 3.0)])
def test_paged_attention_sliding_window_and_softcap(dtype, heads, head_size, window, softcap):
    """Windows shorter than a block, across blocks and 16/32-key chunks, and none (soft cap
    only), on every path: AVX-512 decode rows (64, 128), the tile path (80), plain C (36)."""
    seq_lens, query_lens = [37, 5, 70, 200, 1, 130], [37, 1, 9, 1, 1, 24]
    torch.manual_seed(window + head_size)
    batch = build_paged_batch(seq_lens, query_lens, *heads, head_size=head_size, block_size=16,
                              dtype=dtype)
    k, v = batch.k_cache.contiguous(), batch.v_cache.contiguous()
    args = (batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    got = cpu.paged_attention(*args, 0.3, window, softcap)
    expected = paged_attention_ref(*args, 0.3, batch.max_query_len, batch.max_seq_len, window,
                                   softcap)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    plain = paged_attention_ref(*args, 0.3, batch.max_query_len, batch.max_seq_len)
    assert not torch.allclose(expected.float(), plain.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 8), (torch.bfloat16, 16)])
def test_paged_attention_reads_nothing_before_the_window(dtype, block_size):
    """Blocks wholly before every query's window may be freed: NaN there changes nothing."""
    batch = build_paged_batch([70, 53], [1, 5], 8, 2, head_size=64, block_size=block_size,
                              dtype=dtype)
    k, v = batch.k_cache.contiguous(), batch.v_cache.contiguous()
    args = (batch.query, k, v, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    before = cpu.paged_attention(*args, 0.125, 12)
    for b, first in enumerate([70 - 12, 53 - 5 - 11]):  # each sequence's first visible key
        for j in range(first // block_size):
            k[int(batch.block_tables[b, j])] = float("nan")
            v[int(batch.block_tables[b, j])] = float("nan")
    assert torch.equal(cpu.paged_attention(*args, 0.125, 12), before)


@pytest.mark.skipif(settings.isa_class() != "amx", reason="AMX tiles: Sapphire Rapids and later")
def test_amx_attention_takes_bfloat16_caches_in_whole_16_key_chunks():
    """On AMX machines the tile path takes bfloat16 queries over bfloat16 caches (head sizes a
    multiple of 32 up to 256, blocks a multiple of 16 keys, GQA groups up to 16); the tests
    above then run it against the reference. Everything else keeps the AVX-512 paths."""
    def takes(dtype: int, kv_dtype: int, head_size: int, block_size: int, group: int) -> bool:
        return cpu_kernels.call("attend_amx_supported", dtype, kv_dtype, head_size, block_size, group) == 1
    assert takes(1, 1, 64, 16, 7) and takes(1, 1, 128, 128, 16) and takes(1, 1, 32, 32, 1)
    assert not takes(0, 0, 64, 16, 7)  # float32
    assert not takes(1, 2, 64, 16, 7)  # fp8 cache
    assert not takes(1, 1, 80, 16, 4) and not takes(1, 1, 288, 16, 4)  # head sizes
    assert not takes(1, 1, 64, 8, 7)  # blocks of 8 keys
    assert not takes(1, 1, 64, 16, 17)  # more query vectors than a tile's 16 rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [896, 40])  # 40: the scalar tail after the vector loop
def test_rms_norm_and_fused_residual(dtype, hidden):
    torch.manual_seed(hidden)
    x = (torch.randn(37, hidden) * 3).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    residual = torch.randn(37, hidden).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6),
                               **TOL[dtype])
    res_c, res_ref = residual.clone(), residual.clone()
    out_c = cpu.rms_norm(x, weight, 1e-6, res_c)
    out_ref, _ = fused_add_rms_norm_ref(x, res_ref, weight, 1e-6)
    assert torch.equal(res_c, res_ref)  # the residual is x + residual rounded once
    torch.testing.assert_close(out_c, out_ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = (torch.randn(19, 2 * 4867) * 4).to(dtype)  # odd width: vector loop plus scalar tail
    x[0, :3] = torch.tensor([-100.0, 100.0, 0.0]).to(dtype)  # exp under- and overflow
    got = cpu.silu_and_mul(x)
    torch.testing.assert_close(got, silu_and_mul_ref(x), **TOL[dtype])
    assert got[0, 0] == 0 and got[0, 2] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 48])
def test_rotary_on_strided_views(dtype, head_size):
    """q and k are views into the qkv product (rows strided), rotated in place."""
    hq, hk, tokens = 6, 2, 11
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_size).to(dtype)
    q, k, _ = qkv.split([hq * head_size, hk * head_size, hk * head_size], dim=-1)
    q_ref, k_ref = q.clone(), k.clone()
    freqs = torch.outer(torch.arange(64.0), torch.rand(head_size // 2))
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, 64, (tokens,))
    v_before = qkv[:, (hq + hk) * head_size :].clone()
    cpu.rotary_embedding(positions, q, k, cache, head_size)
    rotary_embedding_ref(positions, q_ref, k_ref, cache, head_size)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * head_size :], v_before)  # v untouched


def test_store_kv_matches_reference_and_skips_minus_one():
    kv = torch.randn(9, 2 * 2 * 64).bfloat16()
    key, value = kv[:, :128].view(9, 2, 64), kv[:, 128:].view(9, 2, 64)  # strided views
    slots = torch.tensor([5, -1, 40, 0, 17, 63, -1, 33, 8])
    caches = [torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16) for _ in range(4)]
    cpu.store_kv_cache(key, value, caches[0], caches[1], slots)
    store_kv_cache_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].flatten(0, 1)[5].equal(key[0]) and caches[1].flatten(0, 1)[63].equal(value[5])


def test_auto_backend_takes_the_c_kernels_and_reference_forces_torch(monkeypatch):
    calls = []
    real = cpu.silu_and_mul
    monkeypatch.setattr(cpu, "silu_and_mul", lambda x: calls.append(1) or real(x))
    x = torch.randn(4, 32)
    ops.silu_and_mul(x)
    assert calls == [1]
    with settings.backend("reference"):
        assert torch.equal(ops.silu_and_mul(x), silu_and_mul_ref(x))
    assert calls == [1]


def test_disabled_c_kernels_fall_back_to_torch():
    # PAGEDSERVE_CPU_KERNELS=0 is the default of the engine's cpu_kernels switch, which the
    # engine hands to kernels.settings
    code = (
        "import torch\n"
        "from engine import envs\n"
        "from engine.config import DeviceConfig, configure_kernels\n"
        "from kernels import cpu_kernels, ops\n"
        "from kernels.activation import silu_and_mul_ref\n"
        "assert cpu_kernels.settings.current().cpu_kernels\n"
        "configure_kernels(DeviceConfig())\n"
        "assert not cpu_kernels.available()\n"
        "x = torch.randn(3, 8)\n"
        "assert torch.equal(ops.silu_and_mul(x), silu_and_mul_ref(x))\n"
    )
    env = dict(os.environ, PAGEDSERVE_CPU_KERNELS="0")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)


def test_missing_compiler_warns_and_falls_back(tmp_path):
    code = (
        "import logging, torch\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "import sys\n"
        "from kernels import cpu_kernels, ops, settings\n"
        "settings.configure(build_dir=sys.argv[1])\n"
        "assert not cpu_kernels.available()\n"
        "x = torch.randn(3, 8)\n"
        "assert ops.rms_norm(x, torch.ones(8), 1e-6).shape == (3, 8)\n"
    )
    env = dict(os.environ, CC="no-such-compiler")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                          timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "CPU kernels unavailable" in proc.stderr and "no-such-compiler" in proc.stderr


@pytest.mark.skipif(not cpu_gemm.packing_supported(torch.empty(2, 2, dtype=torch.bfloat16)),
                    reason="no oneDNN bfloat16 support on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_gives_the_bits_of_f_linear(rows):
    weight = torch.randn(96, 40).bfloat16()
    bias = torch.randn(96).bfloat16()
    x = torch.randn(rows, 40).bfloat16()
    packed = cpu_gemm.pack_onednn(weight)
    assert torch.equal(cpu_gemm.packed_linear(x, packed, bias), F.linear(x, weight, bias))
    assert torch.equal(cpu_gemm.packed_linear(x, packed, None), F.linear(x, weight))


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_float32_linear_matches_f_linear(rows):
    # float32 weights are prepacked on every CPU (MKL's sgemm is slower on decode shapes): oneDNN
    weight, bias, x = torch.randn(96, 40), torch.randn(96), torch.randn(rows, 40)
    assert cpu_gemm.packing_supported(weight)
    packed = cpu_gemm.pack_onednn(weight)
    torch.testing.assert_close(cpu_gemm.packed_linear(x, packed, bias), F.linear(x, weight, bias))
    assert cpu_gemm.warm_up([(packed, bias)], 16) == 16


def test_packed_rows_run_in_few_buckets_of_little_padding():
    # oneDNN builds a kernel per row count: any M from 1 to 2048 runs in one of 128, exact below
    # 32, then 16 per doubling; a bucket adds at most a sixteenth of M's rows
    assert [cpu_gemm.padded_rows(m) for m in (1, 9, 25, 31, 32, 33, 65, 256, 257, 300, 2048)] \
        == [1, 9, 25, 31, 32, 34, 68, 256, 272, 304, 2048]
    assert len({cpu_gemm.padded_rows(m) for m in range(1, 2049)}) == 31 + 6 * 16 + 1
    assert max((cpu_gemm.padded_rows(m) - m) / m for m in range(1, 5000)) < 1 / 16
    assert cpu_gemm.row_buckets(70) == [*range(1, 32), *range(32, 64, 2), 64, 68, 72]


@pytest.mark.skipif(not cpu_gemm.packing_supported(torch.empty(2, 2, dtype=torch.bfloat16)),
                    reason="no oneDNN bfloat16 support on this CPU")
def test_warm_up_runs_each_weight_shape_once_per_bucket():
    a, b, c = (cpu_gemm.pack_onednn(torch.randn(n, 32).bfloat16()) for n in (48, 48, 80))
    bias = torch.zeros(48).bfloat16()
    # a and b share a shape; with a bias it is another kernel
    assert cpu_gemm.warm_up([(a, None), (b, None), (c, None), (a, bias)], 100) == 3 * 57
    # a product too big for its kernel's build to matter is left to its first use
    big = cpu_gemm.pack_onednn(torch.randn(1 << 16, 1 << 10).bfloat16())  # 2**26 MACs a row
    assert cpu_gemm.warm_up([(big, None)], 100) == 4


_DENSE = pytest.mark.skipif(not cpu_gemm.dense_kernel_used(torch.empty(2, 2, dtype=torch.bfloat16)),
                            reason="bfloat16 goes to the C dense kernel where bf16 is native")


@_DENSE
@pytest.mark.parametrize("n,k", [(64, 896), (100, 33), (151, 7), (1152, 896), (130, 4864),
                                 (70, 64), (100, 64)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 17, 29, 33, 64, 301])
def test_dense_bfloat16_linear_matches_float64(n, k, rows):
    # channels past a panel of 64, odd inputs, row tiles of 6 and their remainders; on AMX
    # (inputs a multiple of 32) tiles of 16 rows in pairs, and panels whose second half of 32
    # channels is partly (100) or wholly (70) padding; sums in float32 in another order than
    # oneDNN's: within one bfloat16 rounding of the exact product
    torch.manual_seed(n * rows + k)
    weight, bias = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
    base = torch.randn(rows, k + 3).bfloat16()
    packed = cpu_gemm.pack(weight)
    assert isinstance(packed, cpu_gemm.DensePacked) and (packed.n, packed.k) == (n, k)
    for x in (base[:, :k], base[:, :k].contiguous()):  # rows strided and contiguous
        for b in (None, bias):
            exact = x.double() @ weight.double().T + (0 if b is None else b.double())
            got = cpu_gemm.packed_linear(x, packed, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            torch.testing.assert_close(got.double(), exact, rtol=2**-7, atol=1e-2)
            assert torch.equal(got, cpu_gemm.packed_linear(x.contiguous(), packed, b))


@pytest.mark.skipif(not cpu_gemm.dense_kernel_used(torch.empty(2, 2)),
                    reason="no float32 C dense kernel for this CPU class")
@pytest.mark.parametrize("n,k", [(64, 896), (100, 33), (151, 7), (130, 4864)])
@pytest.mark.parametrize("rows", [1, 6, 7, 29, 301])
def test_dense_float32_linear_is_as_accurate_as_f_linear(n, k, rows):
    # a float32 sum in another order: its error against float64 is of F.linear's size
    torch.manual_seed(n * rows + k)
    weight, bias = torch.randn(n, k), torch.randn(n)
    x = torch.randn(rows, k + 3)[:, :k]
    packed = cpu_gemm.pack(weight)
    assert isinstance(packed, cpu_gemm.DensePacked)
    for b in (None, bias):
        exact = x.double() @ weight.double().T + (0 if b is None else b.double())
        got = cpu_gemm.packed_linear(x, packed, b)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        ours = (got.double() - exact).abs().max().item()
        theirs = (F.linear(x, weight, b).double() - exact).abs().max().item()
        assert ours <= 4 * theirs + 1e-5


# rows x inputs past the kernel's blocking (dense_linear_cpu.c): several row blocks over each
# group of panels (inputs of 896), inputs of more than 12 MiB (row blocks over all panels where
# a row block has a panel's width of rows: 1024 inputs with AVX-512 float32, 4864 with AVX2; on
# AMX, more than 32 MiB), and outputs of more than 8 MiB (stored streaming)
_BLOCKED = [(1152, 896, 400), (200, 4864, 700), (200, 4864, 1300), (40, 4864, 3500),
            (100, 1024, 3200), (80000, 64, 64)]


def test_dense_linear_across_row_blocks_and_panel_groups():
    ran = 0
    for dtype, check in ((torch.float32, test_dense_float32_linear_is_as_accurate_as_f_linear),
                         (torch.bfloat16, test_dense_bfloat16_linear_matches_float64)):
        if cpu_gemm.dense_kernel_used(torch.empty(2, 2, dtype=dtype)):
            for n, k, rows in _BLOCKED:
                check(n, k, rows)
                ran += 1
    if not ran:
        pytest.skip("no C dense kernel for this CPU class")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(100, 64), (1152, 896), (64, 4864)])
def test_prompt_sized_products_give_the_bits_of_small_ones(dtype, n, k):
    # a product of many rows runs in other loops than one of a few (k-blocked over several
    # tiles, the sums kept in memory between blocks: on AMX, and the vector tiles' float32),
    # but every row's sum runs over its inputs in the same order: the same bits as the rows
    # taken 32 at a time (one AMX tile) and 12 at a time (two vector tiles, not k-blocked)
    if not cpu_gemm.dense_kernel_used(torch.empty(2, 2, dtype=dtype)):
        pytest.skip(f"no C dense kernel for {dtype} on this CPU class")
    torch.manual_seed(n + k)
    weight, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    x = torch.randn(333, k).to(dtype)
    packed = cpu_gemm.pack(weight)
    whole = cpu_gemm.packed_linear(x, packed, bias)
    for step in (32, 12):
        assert torch.equal(whole, torch.cat([cpu_gemm.packed_linear(x[i:i + step], packed, bias)
                                             for i in range(0, 333, step)]))
    gated = cpu_gemm.pack_gated(torch.cat([weight, weight.flip(0)]))
    if gated is not None:
        whole = cpu_gemm.packed_linear(x, gated, None)
        assert torch.equal(whole, torch.cat([cpu_gemm.packed_linear(x[i:i + 32], gated, None)
                                             for i in range(0, 333, 32)]))


def _gated_or_skip(weight: torch.Tensor) -> cpu_gemm.DensePacked:
    fused = cpu_gemm.pack_gated(weight)
    if fused is None:
        pytest.skip(f"no fused gate-up product for {weight.dtype} on this CPU class")
    return fused


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(100, 64), (20, 64), (70, 896), (64, 4864), (40, 33)])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 300])
def test_gated_product_is_silu_and_mul_of_the_product_bit_for_bit(dtype, n, k, rows):
    # gate and up interleaved in blocks of half a panel (n not a multiple of it: the last block
    # padded; n % 16 != 0: silu_and_mul's scalar tail); the fused epilogue rounds as the
    # product's store and silu_and_mul_cpu do. k = 33: vector tiles even on AMX (odd inputs)
    torch.manual_seed(n * rows + k)
    weight = torch.randn(2 * n, k).to(dtype)
    fused, plain = _gated_or_skip(weight), cpu_gemm.pack(weight)
    assert fused.gated and (fused.n, fused.k) == (n, k)
    base = torch.randn(rows, k + 3).to(dtype)
    for x in (base[:, :k], base[:, :k].contiguous()):
        two_steps = ops.silu_and_mul(cpu_gemm.packed_linear(x, plain, None))
        assert torch.equal(cpu_gemm.packed_linear(x, fused, None), two_steps)
    with pytest.raises(ValueError, match="no bias"):
        cpu_gemm.packed_linear(base[:, :k], fused, torch.zeros(n).to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_product_at_prompt_size_streams_its_stores_and_keeps_the_bits(dtype):
    # 2048 x 2400 outputs are over the kernel's streaming size (stored with non-temporal
    # stores), and 2048 rows run the prompt-sized paths (row blocks; k-blocked float32 tiles)
    torch.manual_seed(5)
    weight = torch.randn(4800, 128).to(dtype)
    fused, plain = _gated_or_skip(weight), cpu_gemm.pack(weight)
    x = torch.randn(2048, 128).to(dtype)
    assert torch.equal(cpu_gemm.packed_linear(x, fused, None),
                       ops.silu_and_mul(cpu_gemm.packed_linear(x, plain, None)))


def test_gated_packing_declines_what_it_cannot_fuse():
    assert cpu_gemm.pack_gated(torch.randn(41, 64).bfloat16()) is None  # no two halves
    assert cpu_gemm.pack_gated(torch.randn(40, 64).half()) is None  # no C kernel for float16
    for dtype in (torch.bfloat16, torch.float32):  # fused wherever the C kernel runs the dtype
        used = cpu_gemm.dense_kernel_used(torch.empty(2, 2, dtype=dtype))
        assert (cpu_gemm.pack_gated(torch.randn(40, 64).to(dtype)) is not None) == used


@_DENSE
def test_dense_linear_needs_no_warm_up_and_pads_to_panels():
    weight = torch.randn(70, 16).bfloat16()
    packed = cpu_gemm.pack(weight)
    assert cpu_gemm.warm_up([(packed, None)], 64) == 0
    assert packed.data.numel() == 128 * 16  # two panels of 64 channels, the second padded
    x = torch.randn(3, 16).bfloat16()
    out = cpu_gemm.packed_linear(x, packed, None)
    assert out.shape == (3, 70) and torch.isfinite(out).all()
    assert cpu_gemm.packed_linear(x[:0], packed, None).shape == (0, 70)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grammar_mask_matches_xgrammar(dtype):
    """The C mask sets exactly the tokens xgrammar's own CPU masking does, in place, on the
    given rows only, for float32 and bfloat16 logits (a vocabulary not a multiple of 32)."""
    xgr = pytest.importorskip("xgrammar")
    from kernels import ops

    if not ops.can_mask_logits(torch.zeros(1, 8)):
        pytest.skip("no C kernels")
    torch.manual_seed(0)
    vocab, rows = 1000, [0, 2, 3]
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[2] = -1  # everything allowed
    bitmask[3] = 0  # nothing allowed
    logits = torch.randn(4, vocab).to(dtype)
    want = logits.float().clone()
    xgr.apply_token_bitmask_inplace(want, bitmask, indices=rows)
    ops.mask_logits(logits, bitmask, rows)
    assert torch.equal(logits.float(), want.to(dtype).float())
    assert torch.isinf(logits[3]).all() and not torch.isinf(logits[1]).any()
    assert torch.isinf(logits[0]).sum() == (want[0] == -torch.inf).sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_are_torchs_max_indices(dtype):
    """The C argmax picks torch's token on every row: widths around the vector loop's (two
    vectors of 8 or 16 lanes), ties (the first maximum), rows of -inf, NaNs (the first NaN),
    and rows strided by more than their width."""
    from kernels import ops

    if not ops.can_mask_logits(torch.zeros(1, 8)):
        pytest.skip("no C kernels")
    torch.manual_seed(1)
    for vocab in (1, 7, 15, 16, 17, 31, 32, 33, 48, 100, 768, 151936):
        cases = [torch.randn(6, vocab), torch.zeros(6, vocab), torch.full((6, vocab), -torch.inf)]
        cases[0][1, vocab // 3] = 1e9  # a clear winner, and row 0's own maximum
        cases[1][2, vocab // 2:] = 1.0  # ties: the first of the ones
        nan = torch.randn(6, vocab)
        nan[0, vocab - 1] = nan[3, vocab // 2] = nan[3, vocab - 1] = nan[4, 0] = torch.nan
        wide = torch.randn(6, vocab + 5)[:, :vocab]  # rows further apart than their width
        for logits in [*cases, nan, wide]:
            logits = logits.to(dtype)
            got = ops.greedy_tokens(logits)
            assert got.dtype == torch.int64
            assert got.tolist() == logits.max(dim=-1).indices.tolist(), (vocab, logits)
    ties = torch.zeros(3, 40, dtype=dtype)
    ties[:, [5, 21, 37]] = 2.0
    assert ops.greedy_tokens(ties).tolist() == [5, 5, 5]


def test_top_p_threshold_is_the_sorted_nucleus_s_last_probability():
    """The C kernel's nucleus thresholds equal the sort's: peaked and flat rows (a flat row
    puts its whole vocabulary in one histogram bucket), rows that do not sum to 1, zeros,
    ties at the boundary, top-p of almost 1 and of almost 0, rows strided by more than their
    width."""
    from kernels import ops

    if not ops.can_mask_logits(torch.zeros(1, 8)):
        pytest.skip("no C kernels")
    torch.manual_seed(2)
    for vocab in (1, 2, 17, 768, 151936):
        rows = [torch.softmax(torch.randn(vocab) * s, dim=0) for s in (0.1, 1.0, 4.0, 20.0)]
        rows.append(torch.full((vocab,), 1.0 / vocab))  # flat: one bucket
        rows.append(torch.rand(vocab) * (torch.rand(vocab) > 0.3))  # zeros, not normalized
        tied = torch.zeros(vocab)
        tied[: max(1, vocab // 4)] = 0.5  # many equal values across the boundary
        rows.append(tied)
        probs = torch.stack(rows)
        wide = torch.cat([probs, torch.rand(len(rows), 3)], dim=1)[:, :vocab]
        for top_p in (1e-6, 0.3, 0.8, 0.95, 0.999):
            limits = torch.full((len(rows),), top_p)
            want = ops.top_p_threshold_ref(probs, limits)
            assert ops.top_p_threshold(probs, limits).tolist() == want.tolist(), (vocab, top_p)
            assert ops.top_p_threshold(wide, limits).tolist() == want.tolist()
    mixed = torch.full((3,), 0.0)
    mixed[:] = torch.tensor([0.1, 0.5, 0.99])
    peaked = torch.softmax(torch.randn(3, 5000) * 3, dim=-1)
    assert ops.top_p_threshold(peaked, mixed).tolist() == \
        ops.top_p_threshold_ref(peaked, mixed).tolist()
