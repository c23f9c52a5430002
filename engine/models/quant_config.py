"""A checkpoint's own quantization: ``config.json``'s ``quantization_config``, read with the
``compressed-tensors`` library's config classes (the format vLLM and llm-compressor use).

Supported: one group of schemes over the linear layers, 8-bit symmetric weights with one scale
per output channel, as int8 (``int-quantized``, or ``pack-quantized``: four values to an int32
word, what llm-compressor writes for weight-only W8A16; W8A16, or W8A8 with dynamic per-token
activations) or FP8 E4M3 (``float-quantized``: FP8 W8A16 or W8A8 dynamic), the LM head left
unquantized (``ignore: [lm_head]``); and a ``kv_cache_scheme`` of FP8 with one static scale per
tensor (each attention layer's ``k_scale``/``v_scale``, used by ``kv_cache_dtype="fp8"``).
Anything else is a start-up error naming what is not supported. How the weights then run:
``CheckpointQuant``'s fields, and ``engine.layers.linear.LinearBase.expect_quantized``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

SUPPORTED = ("compressed-tensors with 8-bit symmetric channel-wise weights (int8 or fp8 e4m3) "
             "and no or dynamic per-token input activations")


@dataclass(frozen=True)
class CheckpointQuant:
    weight_type: str  # "int" (int8 values) or "float" (float8_e4m3fn values)
    activations: str  # "none" (weight-only) or "dynamic-token"
    packed: bool = False  # int8 values four to an int32 word (format "pack-quantized")
    kv_scales: bool = False  # per-tensor fp8 KV scales (k_scale, v_scale) per attention layer

    @property
    def label(self) -> str:
        """What the Worker reports, e.g. ``compressed-tensors:int8-w8a8``."""
        weights = "int8" if self.weight_type == "int" else "fp8"
        acts = "w8a16" if self.activations == "none" else "w8a8"
        return f"compressed-tensors:{weights}-{acts}"


def parse_checkpoint_quant(raw: object, where: str = "config.json") -> CheckpointQuant | None:
    """``quantization_config`` (None when absent) -> what to load; ``ValueError`` naming the
    method, scheme or field that is not supported."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: quantization_config must be a mapping")
    method = raw.get("quant_method", "unknown")
    if method != "compressed-tensors":
        raise ValueError(f"{where}: quantization_config with quant_method {method!r} is not "
                         f"supported; supported: {SUPPORTED}")
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    try:
        config = QuantizationConfig.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                             for err in e.errors())
        raise ValueError(f"{where}: quantization_config: {problems}") from None
    _check_extras(config, raw, where)
    schemes = list(config.config_groups.values())
    if len(schemes) != 1:
        raise ValueError(f"{where}: quantization_config has {len(schemes)} config_groups; "
                         "supported: one group over the linear layers")
    quant = _from_scheme(schemes[0], config.format, where)
    return replace(quant, kv_scales=_kv_scales(config.kv_cache_scheme, where))


def _kv_scales(kv: Any, where: str) -> bool:
    """Whether the checkpoint carries fp8 KV-cache scales: ``kv_cache_scheme`` absent, or FP8
    E4M3 with one static symmetric scale per tensor (``k_scale``/``v_scale`` of each attention
    layer, what vLLM reads); anything else is refused naming it."""
    if kv is None:
        return False
    if not (kv.num_bits == 8 and kv.type == "float" and kv.strategy == "tensor"
            and kv.symmetric and not kv.dynamic):
        raise ValueError(f"{where}: quantization_config.kv_cache_scheme "
                         f"{kv.model_dump(exclude_none=True)} is not supported; supported: "
                         "8-bit float, strategy tensor, symmetric, static")
    return True


def _check_extras(config: Any, raw: dict[str, Any], where: str) -> None:
    for key in ("sparsity_config", "transform_config"):
        if raw.get(key):
            raise ValueError(f"{where}: quantization_config.{key} is not supported")
    others = [name for name in config.ignore or [] if name != "lm_head"]
    if others:
        raise ValueError(f"{where}: quantization_config.ignore lists {others[:4]}: only "
                         "lm_head may be left unquantized")


def _from_scheme(scheme: Any, fmt: str | None, where: str) -> CheckpointQuant:
    w = scheme.weights
    what = f"{where}: quantization scheme {scheme.model_dump(exclude_none=True)}"
    if "Linear" not in scheme.targets or w is None:
        raise ValueError(f"{what} does not quantize the Linear layers' weights; supported: "
                         f"{SUPPORTED}")
    if (w.num_bits != 8 or not w.symmetric or w.strategy != "channel" or w.group_size
            or w.dynamic or w.type not in ("int", "float")):
        raise ValueError(f"{what} is not supported (weights: num_bits {w.num_bits}, type "
                         f"{w.type}, strategy {w.strategy}, symmetric {w.symmetric}); "
                         f"supported: {SUPPORTED}")
    formats = {"int": ("int-quantized", "naive-quantized", "pack-quantized"),
               "float": ("float-quantized", "naive-quantized")}
    used = [f for f in (fmt, scheme.format) if f is not None]
    for f in used:
        if f not in formats[w.type]:
            raise ValueError(f"{what}: format {f!r} is not supported for {w.type} weights "
                             f"(supported: {', '.join(formats[w.type])})")
    a = scheme.input_activations
    if a is not None and not (a.dynamic is True and a.strategy == "token" and a.num_bits == 8):
        raise ValueError(f"{what}: input activations must be absent (weight-only) or dynamic "
                         "per-token 8-bit")
    if scheme.output_activations is not None:
        raise ValueError(f"{what}: output activation quantization is not supported")
    return CheckpointQuant(w.type, "none" if a is None else "dynamic-token",
                           packed="pack-quantized" in used)
