"""The CPU's instruction-set class, the cap a developer sets to measure a lower class, and what
follows from the class: whether bfloat16 is native, and the C kernels' compiler flags.

Classes, lowest first:

| class | what it adds | bfloat16 |
|---|---|---|
| ``generic`` | x86-64 baseline (SSE2), or another architecture | emulated |
| ``avx2`` | AVX2 and FMA (AMD Zen 1-3, Intel Haswell to Comet Lake) | emulated |
| ``avx512`` | AVX-512 F/BW/VL (Intel Skylake-SP to Ice Lake) | emulated |
| ``avx512_bf16`` | AVX512-BF16 dot products (AMD Zen 4/5, Intel Cooper Lake) | native |
| ``amx`` | AMX-BF16 tiles (Intel Sapphire Rapids and later) | native |

A cap lowers the class (``kernels.settings``' ``isa_cap``, which the engine sets from
``PAGEDSERVE_CPU_ISA``; ``settings.isa_class`` is this machine's class under it): the C kernels
are then built for it and ``dtype="auto"`` chooses as on such a CPU. This module holds the
facts only; it reads no switch. oneDNN, MKL and ATen have their own caps, read
once when the process starts; ``isa_env`` gives all four for a process measuring a class.
"""

from __future__ import annotations

from functools import lru_cache

CLASSES = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
_NEEDS = {  # /proc/cpuinfo flags each class needs
    "avx2": {"avx2", "fma"},
    "avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"},
    "avx512_bf16": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    "amx": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16",
            "amx_tile"},
}
# gcc -march for a class below the machine's own (the machine's own class builds -march=native)
_MARCH = {"generic": "x86-64", "avx2": "haswell", "avx512": "skylake-avx512",
          "avx512_bf16": "cooperlake", "amx": "sapphirerapids"}
# the other libraries' caps: oneDNN, MKL, ATen (None: no cap of that library's)
_LIBRARY_CAPS = {
    "generic": ("SSE41", "SSE4_2", "default"),
    "avx2": ("AVX2", "AVX2", "avx2"),
    "avx512": ("AVX512_CORE", "AVX512", "avx512"),
    "avx512_bf16": ("AVX512_CORE_BF16", "AVX512", "avx512"),
    "amx": ("AVX512_CORE_AMX", None, None),
}


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of this machine's first CPU (empty where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def detect(flags: frozenset[str] | set[str]) -> str:
    """The highest class whose flags are all in ``flags``."""
    best = "generic"
    for name in CLASSES[1:]:
        if _NEEDS[name] <= set(flags):
            best = name
    return best


def isa_class(flags: frozenset[str] | set[str] | None = None, cap: str | None = None) -> str:
    """This machine's class (or the one of ``flags``), lowered to ``cap`` (None: no cap)."""
    found = detect(cpu_flags() if flags is None else flags)
    if cap is not None and CLASSES.index(cap) < CLASSES.index(found):
        return cap
    return found


def native_bf16(isa: str) -> bool:
    """Whether bfloat16 arithmetic is native on this class (dot products in hardware)."""
    return isa in ("avx512_bf16", "amx")


def march_flags(isa: str) -> list[str]:
    """The C kernels' -march for ``isa`` (``-march=native`` for this machine's own class)."""
    if isa == detect(cpu_flags()):
        return ["-march=native"]
    return [f"-march={_MARCH[isa]}", "-mtune=generic"]


def isa_env(isa: str) -> dict[str, str]:
    """Environment for a process that should run as on a CPU of class ``isa``: this project's
    cap and oneDNN's, MKL's and ATen's (each library reads its own once, at start)."""
    if isa not in CLASSES:
        raise ValueError(f"isa must be one of {', '.join(CLASSES)}, got {isa!r}")
    onednn, mkl, aten = _LIBRARY_CAPS[isa]
    env = {"PAGEDSERVE_CPU_ISA": isa, "ONEDNN_MAX_CPU_ISA": onednn}
    if mkl:
        env["MKL_ENABLE_INSTRUCTIONS"] = mkl
    if aten:
        env["ATEN_CPU_CAPABILITY"] = aten
    return env
