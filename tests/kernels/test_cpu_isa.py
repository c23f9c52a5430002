"""CPU classes: detection from the CPU's flags, the developer's cap, ``dtype="auto"`` per class
(the capability probe injected), and the C kernels built for every class, those this CPU can
run checked against the torch references (a build for a class above it only compiles)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from engine import envs
from engine.config import DeviceConfig, configure_kernels
from engine.loader import resolve_dtype
from kernels import cpu_isa, settings
from kernels import cpu_kernels as cpu
from tests.kernels import test_cpu_kernels as kernel_tests
from tests.kernels import test_fp8_kv as fp8_tests
from tests.kernels import test_quant_linear as quant_tests

ZEN3 = {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}  # an AVX2-only AMD EPYC
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
ZEN4 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}
CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, isa", [
    (set(), "generic"), ({"sse2", "avx"}, "generic"), (ZEN3, "avx2"), (SKYLAKE_SP, "avx512"),
    (ZEN4, "avx512_bf16"), (SAPPHIRE_RAPIDS, "amx")])
def test_class_from_flags(flags, isa):
    assert cpu_isa.detect(flags) == isa
    assert cpu_isa.isa_class(flags, cap="amx") == isa
    assert cpu_isa.isa_class(flags, cap="avx2") == min(isa, "avx2", key=cpu_isa.CLASSES.index)
    assert cpu_isa.native_bf16(isa) == (isa in ("avx512_bf16", "amx"))


def test_the_cap_comes_from_the_environment(monkeypatch):
    # read once into the engine's settings, handed to kernels.settings by engine.config.configure_kernels
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "generic")
    envs.reload()
    configure_kernels(DeviceConfig())
    assert settings.isa_class(SAPPHIRE_RAPIDS) == "generic"
    assert cpu_isa.march_flags(settings.isa_class()) == ["-march=x86-64", "-mtune=generic"]
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA must be one of generic, avx2"):
        envs.reload()
    monkeypatch.delenv("PAGEDSERVE_CPU_ISA")
    envs.reload()
    configure_kernels(DeviceConfig())
    assert settings.isa_class() == cpu_isa.detect(cpu_isa.cpu_flags())
    assert cpu_isa.march_flags(settings.isa_class()) == ["-march=native"]


def test_isa_env_caps_every_library():
    assert cpu_isa.isa_env("avx2") == {
        "PAGEDSERVE_CPU_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    assert cpu_isa.isa_env("amx") == {"PAGEDSERVE_CPU_ISA": "amx",
                                      "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_isa.isa_env("sse9")


@pytest.mark.parametrize("checkpoint, native, expected", [
    ("bfloat16", False, torch.float32),  # AVX2 / AVX-512 without BF16: emulated bf16 is ~3x slower
    ("float16", False, torch.float32),
    ("bfloat16", True, torch.bfloat16),  # AVX512-BF16, AMX
    ("float16", True, torch.bfloat16),
    ("float32", True, torch.float32),
    (None, False, torch.float32)])
def test_auto_dtype_is_the_fastest_the_cpu_has(checkpoint, native, expected):
    assert resolve_dtype("auto", checkpoint, CPU, native_bf16=native) == expected


def test_a_gpu_keeps_the_checkpoint_dtype():
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", "bfloat16", cuda, native_bf16=False) == torch.bfloat16
    assert resolve_dtype("auto", "float16", cuda, native_bf16=False) == torch.float16


def test_forcing_bfloat16_without_native_support_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.loader"):
        assert resolve_dtype("bfloat16", "bfloat16", CPU, native_bf16=False) == torch.bfloat16
        assert resolve_dtype("bfloat16", "bfloat16", CPU, native_bf16=True) == torch.bfloat16
        assert resolve_dtype("float32", "bfloat16", CPU, native_bf16=False) == torch.float32
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "about 3x slower than float32" in warnings[0]


def _runnable(isa: str) -> bool:
    here = cpu_isa.detect(cpu_isa.cpu_flags())
    return cpu_isa.CLASSES.index(isa) <= cpu_isa.CLASSES.index(here)


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
@pytest.mark.parametrize("isa", cpu_isa.CLASSES)
def test_c_kernels_build_for_every_class_and_match_the_references(isa, monkeypatch):
    path = cpu.build(isa)
    assert path.exists() and path == cpu.library_path(isa)
    if not _runnable(isa):
        pytest.skip(f"built; this CPU ({cpu_isa.detect(cpu_isa.cpu_flags())}) cannot run {isa}")
    monkeypatch.setattr(cpu, "_lib", cpu.load(isa))
    monkeypatch.setattr(cpu, "_tried", True)
    for dtype in (torch.float32, torch.bfloat16):
        # 64 and 128: AVX-512's decode rows; every size a multiple of 8: the tile path of
        # the class's vector width (AVX2 decodes too); 36: the plain-C path
        for heads, head_size in [((14, 2), 64), ((8, 2), 128), ((4, 1), 80), ((6, 2), 32),
                                 ((4, 2), 36)]:
            kernel_tests.test_paged_attention_matches_reference(dtype, heads, head_size, 16)
            kernel_tests.test_paged_attention_sliding_window_and_softcap(dtype, heads, head_size,
                                                                         19, 3.0)
        kernel_tests.test_rms_norm_and_fused_residual(dtype, 40)
        kernel_tests.test_rms_norm_and_fused_residual(dtype, 896)
        kernel_tests.test_silu_and_mul(dtype)
        kernel_tests.test_rotary_on_strided_views(dtype, 48)
        kernel_tests.test_grammar_mask_matches_xgrammar(dtype)
        kernel_tests.test_greedy_tokens_are_torchs_max_indices(dtype)
    kernel_tests.test_top_p_threshold_is_the_sorted_nucleus_s_last_probability()
    if isa != "generic":  # the dense kernel's float32 build (and bfloat16 where native)
        kernel_tests.test_dense_linear_across_row_blocks_and_panel_groups()
        for n, k, rows in [(151, 7, 13), (130, 4864, 29), (100, 33, 301)]:
            kernel_tests.test_dense_float32_linear_is_as_accurate_as_f_linear(n, k, rows)
        for n, k in [(100, 64), (1152, 896), (64, 4864)]:  # k-blocked tiles: the same bits
            kernel_tests.test_prompt_sized_products_give_the_bits_of_small_ones(torch.float32, n, k)
        for dtype in [torch.float32] + ([torch.bfloat16] if cpu_isa.native_bf16(isa) else []):
            for n, k, rows in [(100, 64, 33), (70, 896, 7), (40, 33, 300)]:  # the fused gate-up
                kernel_tests.test_gated_product_is_silu_and_mul_of_the_product_bit_for_bit(
                    dtype, n, k, rows)
            kernel_tests.test_gated_product_at_prompt_size_streams_its_stores_and_keeps_the_bits(
                dtype)
    kernel_tests.test_paged_attention_decode_only_and_padding_rows()
    for heads, head_size in [((14, 2), 64), ((8, 2), 128), ((3, 3), 64)]:  # AMX: shared tiles
        kernel_tests.test_paged_attention_kv_heads_alone_give_the_same_bits(heads, head_size)
    for dtype, block_size in [(torch.float32, 8), (torch.bfloat16, 16)]:  # bfloat16: AMX's tiles
        kernel_tests.test_paged_attention_ignores_cache_outside_the_sequence(dtype)
        kernel_tests.test_paged_attention_reads_nothing_before_the_window(dtype, block_size)
    kernel_tests.test_store_kv_matches_reference_and_skips_minus_one()
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in [(1, 96, 72), (3, 200, 300), (17, 64, 130), (9, 4864, 37), (2, 3, 5)]:
            quant_tests.test_c_int8_product_is_its_torch_arithmetic(dtype, m, k, n)
        fp8_tests.test_c_store_has_torchs_fp8_bits(dtype, (0.37, 2.0))
        for heads, head_size in [((14, 2), 64), ((8, 2), 128), ((4, 1), 80), ((4, 2), 36)]:
            fp8_tests.test_c_attention_reads_fp8_caches(dtype, heads, head_size, 16)
