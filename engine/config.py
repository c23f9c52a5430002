"""Engine configuration: typed, validated once, loadable from YAML.

Every field carries a description; a bad value raises ``ValueError`` naming the field and the
accepted range (pydantic's ``ValidationError`` is a ``ValueError``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from engine import envs
from kernels import settings as kernel_settings

DType = Literal["auto", "float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    model: str | None = Field(
        None,
        description="Path to a Hugging Face checkpoint folder (config.json, *.safetensors, "
        "tokenizer) or a Hub id (owner/name; engine/models/hub.py). None: the default model.",
    )
    revision: str | None = Field(None, description="A Hub id's branch, tag or commit.")
    download_dir: str | None = Field(None, description="A Hub id's cache (None: HF_HUB_CACHE).")
    generation_config: str = Field(
        "auto", description="Sampling defaults for what requests leave unset: 'auto' the "
        "model's generation_config.json, 'vllm' none, or a folder holding such a file.",
    )
    dtype: DType = Field(
        "auto",
        description="Weight and activation dtype. 'auto' takes torch_dtype from config.json, "
        "except that half precision on the CPU becomes bfloat16.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt + output) in tokens; None takes the "
        "model's max_position_embeddings."
    )
    quantization: Literal["int8", "fp8"] | None = Field(
        None, description="Store the weights in lower precision, quantized at load time from "
        "the checkpoint: 'int8' keeps the linear layers', the embedding's and the LM head's "
        "weights as int8 values with one scale per output channel (row), half the bytes of "
        "bfloat16. On the CPU the products run in int8 with activations quantized per token on "
        "the fly; on CUDA a Triton kernel converts the int8 weights to dtype in registers. "
        "'fp8': the linear layers' weights as FP8 E4M3 with one scale per output channel; "
        "on GPUs with FP8 tensor cores (8.9+) the products run in FP8 with activations "
        "quantized per token (torch._scaled_mm), elsewhere the weights are converted to dtype "
        "on the fly. None: dtype throughout.",
    )
    seed: int = Field(0, description="Seed for the default model and for unseeded sampling.")


class CacheConfig(_Strict):
    block_size: int = Field(16, description="Tokens per KV-cache block (a power of two, 8..128).")
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of identical prompt prefixes across requests."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV-cache size in bytes. Required sizing on the CPU (default "
        "1 GiB there); on CUDA it overrides gpu_memory_utilization."
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of GPU memory the engine may use in all "
        "(weights, activations, KV cache) when kv_cache_memory_bytes is not set."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto", description="What the KV cache stores: 'auto' the model's dtype; 'fp8' (or "
        "'fp8_e4m3') FP8 E4M3 with a per-tensor scale (1.0, or the checkpoint's k_scale and "
        "v_scale), one byte per value: twice bfloat16's blocks in the same memory. On CUDA it "
        "needs compute capability 8.9+ (Ada, Hopper).",
    )

    @model_validator(mode="after")
    def _check_block_size(self) -> CacheConfig:
        bs = self.block_size
        if bs < 8 or bs > 128 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two in [8, 128], got {bs}")
        return self


class SchedulerConfig(_Strict):
    max_num_seqs: int = Field(256, ge=1, description="Most requests running in one step.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step (prefill chunks plus decode tokens)."
    )
    separate_prefill_steps: bool | None = Field(
        None, description="When prompts wait, every other step computes only prompt tokens, "
        "so their first tokens do not wait for the running requests' decode tokens (lower "
        "time to first token under load, a little less throughput); otherwise every step "
        "mixes decodes and prompt chunks. None: on CPUs only, where a step's matmuls cost "
        "about the sum of its parts (on GPUs a decode batch takes prompt tokens almost free)."
    )
    step_timeout_s: float | None = Field(
        300.0, gt=0.0, description="AsyncEngine's watchdog: once one step has run this long, "
        "check_health fails, every open stream ends with EngineStalledError and new requests "
        "fail at once (a Serve Worker is replaced). Loading and warm-up are not steps; a first "
        "step's kernel compiles and a slow CPU's full prefill chunk are: raise it for big "
        "models on CPUs. None: no watchdog."
    )


class StructuredOutputConfig(_Strict):
    grammar_compile_timeout_s: float = Field(
        10.0, gt=0.0, description="Longest a request's grammar (structured output: JSON "
        "schema, regex, choice, EBNF) may take to compile against the tokenizer, and longest "
        "it may wait for a compile thread. A grammar past it fails its request with a "
        "ValueError naming the field and this bound (a Worker answers 400); its compile, which "
        "cannot be stopped, runs on in the background and its result is dropped. Typical "
        "schemas take ~0.1 s over a 152k vocabulary (the first compile also builds the "
        "vocabulary's tables, ~1 s).",
    )
    grammar_compile_threads: int = Field(
        2, ge=1, description="Grammars compiled at once. A compile past "
        "grammar_compile_timeout_s gives its thread's place to the next grammar while fewer "
        "than this many such compiles run on in the background, so at most twice this many "
        "threads ever compile.",
    )


class ParallelConfig(_Strict):
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks one model is sharded across.")


class DeviceConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model runs; 'auto' picks CUDA when available."
    )
    num_threads: int | None = Field(
        None, ge=1, description="torch intra-op threads on the CPU; None uses every core."
    )
    enforce_eager: bool = Field(
        False, description="On CUDA, run decode steps eagerly instead of replaying CUDA graphs."
    )
    cpu_kernels: bool = Field(
        default_factory=lambda: envs.settings().cpu_kernels,
        description="On the CPU, run the C kernels (else the torch references). Default: on, "
        "unless PAGEDSERVE_CPU_KERNELS=0.",
    )
    cpu_packed_gemm: bool = Field(
        default_factory=lambda: envs.settings().cpu_packed_gemm,
        description="On the CPU, prepack linear weights for the C dense kernel or oneDNN (else "
        "F.linear). Default: on, unless PAGEDSERVE_CPU_PACKED_GEMM=0.",
    )
    kernel_build_dir: str | None = Field(
        None, description="Where the C kernels are built; None: <cache dir>/kernels "
        "(PAGEDSERVE_CACHE_DIR).",
    )

    def resolve_device(self) -> torch.device:
        """The device ``device`` names ('auto': CUDA when there is one); ``ValueError`` for
        'cuda' without one."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available (accepted: cpu, auto)")
        return torch.device(self.device)

    def cpu_threads(self, share: int = 1, cores: int | None = None) -> int:
        """torch threads for one of ``share`` processes that split this machine's CPU (the
        ranks of one model, or the Workers of a node): ``num_threads`` when set, else the
        cores this process may use (``cores``, default its CPU affinity) split evenly."""
        if self.num_threads is not None:
            return self.num_threads
        if cores is None:
            cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count() or 1)
        return max(1, cores // share)


class EngineConfig(_Strict):
    """All settings of one engine instance."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="What to load.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="KV-cache settings.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="Batching limits."
    )
    structured_output: StructuredOutputConfig = Field(
        default_factory=StructuredOutputConfig, description="Grammar compiles."
    )
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Sharding.")
    device: DeviceConfig = Field(default_factory=DeviceConfig, description="Placement.")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model=..., block_size=...)``)."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in cls.model_fields}
        for key, value in kwargs.items():
            for name, field in cls.model_fields.items():
                if key in _section_fields(field.annotation):
                    sections[name][key] = value
                    break
            else:
                raise ValueError(f"unknown engine argument {key!r}; known: {sorted(_FLAT)}")
        return cls(**sections)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        """Load a YAML file, nested (``cache: {block_size: 16}``) or flat."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of engine settings")
        nested = all(k in cls.model_fields and isinstance(v, dict) for k, v in data.items())
        return cls(**data) if nested else cls.from_kwargs(**data)

    def flat(self) -> dict[str, Any]:
        """The flat keyword form accepted by ``from_kwargs``."""
        out: dict[str, Any] = {}
        for name in type(self).model_fields:
            out.update(getattr(self, name).model_dump())
        return out


def _section_fields(section: object) -> dict[str, FieldInfo]:
    """The fields of one of EngineConfig's sections (each a pydantic model)."""
    if isinstance(section, type) and issubclass(section, BaseModel):
        return section.model_fields
    return {}


_FLAT = {k for f in EngineConfig.model_fields.values() for k in _section_fields(f.annotation)}


def configure_kernels(device: DeviceConfig) -> None:
    """Hand the device section's kernel switches and the ISA cap to ``kernels.settings``."""
    s = envs.settings()
    kernel_settings.configure(
        cpu_kernels=device.cpu_kernels, packed_gemm=device.cpu_packed_gemm,
        build_dir=device.kernel_build_dir or s.cache_dir / "kernels", isa_cap=s.cpu_isa,
        clear_cap=s.cpu_isa is None)
