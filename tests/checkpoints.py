"""Small random-weight checkpoints of real architectures, written with transformers.

``initializer_range=0.2`` (not the default 0.02) makes outputs depend on the context, so a
bug in positions, caching or batching changes the tokens instead of hiding behind a model that
repeats one token forever.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")

BASE = dict(vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)


def make_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0,
                    shard_size: str | None = None, dtype=torch.float32, **overrides) -> Path:
    """Write a random ``arch`` ("llama", "qwen2", "mistral", "qwen3", "phi3", "mixtral",
    "qwen3_moe", "gemma2", "gemma3") checkpoint with the default
    model's tokenizer to ``path``; ``shard_size`` (e.g. "200KB") writes sharded safetensors."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    from engine.models.default_model import default_model_path

    classes = {"llama": (LlamaConfig, LlamaForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM),
               "phi3": (Phi3Config, Phi3ForCausalLM)}
    classes.update(mixtral=(MixtralConfig, MixtralForCausalLM),
                   qwen3_moe=(Qwen3MoeConfig, Qwen3MoeForCausalLM))
    classes.update(gemma2=(Gemma2Config, Gemma2ForCausalLM),
                   gemma3=(Gemma3TextConfig, Gemma3ForCausalLM))
    config_cls, model_cls = classes[arch]
    kwargs = dict(BASE, **overrides)
    if arch in ("gemma2", "gemma3"):  # windows the parity prompts cross; a q scale not head_dim's
        kwargs = dict(BASE, **{"head_dim": 16, "sliding_window": 12,
                               "query_pre_attn_scalar": 24, **overrides})
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    if arch == "qwen3":
        kwargs.setdefault("head_dim", 32)  # 4 heads x 32: q wider than hidden_size
    if arch == "phi3":
        kwargs.setdefault("pad_token_id", None)  # its default, 32000, is past the vocabulary
    if arch == "mixtral":  # 4 experts of intermediate_size, top-2
        kwargs.update(dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
                      **overrides)
    if arch == "qwen3_moe":  # 4 experts of 32, top-2; q/k norms, head_dim 32 as qwen3
        kwargs.update(dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           head_dim=32), **overrides)
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    if arch in ("qwen3", "phi3"):  # norms start at ones: random ones show a misloaded norm
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    if arch in ("gemma2", "gemma3"):  # Gemma's norms scale by 1 + weight, which starts at 0
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(-0.5, 0.5)
    path = Path(path)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    src = default_model_path()
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    return path


COMPRESSED_SCHEMES = ("int8-w8a8", "int8-w8a16", "fp8-w8a8", "fp8-w8a16")


def make_compressed_checkpoint(src: str | Path, path: str | Path, scheme: str,
                               kv_scales: bool = False) -> Path:
    """The checkpoint at ``src`` quantized with the compressed-tensors library, as
    llm-compressor writes it: the Linear layers' weights 8-bit with one scale per output
    channel (``scheme``: "int8"/"fp8" weights, "w8a8" with dynamic per-token activations or
    "w8a16" weight-only), the LM head left out. Scales are the library's own
    (``calculate_qparams``) from each channel's min and max. ``kv_scales``: also the fp8 KV
    cache scheme (one scale per tensor), each attention layer's ``k_scale``/``v_scale`` set to
    twice the largest |key| (|value|) of a calibration pass over 32 tokens, / 448."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    weights, acts = scheme.split("-")
    kind = "int" if weights == "int8" else "float"
    args = dict(num_bits=8, type=kind, symmetric=True)
    quant_scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**args, strategy="channel"),
        input_activations=(QuantizationArgs(**args, strategy="token", dynamic=True)
                           if acts == "w8a8" else None))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    kv_amax = _kv_amax(model) if kv_scales else {}
    kv_scheme = QuantizationArgs(**{**args, "type": "float"}, strategy="tensor")
    with _attention_recognised(kv_scales):  # from applying the scheme to writing config.json
        apply_quantization_config(model, QuantizationConfig(
            config_groups={"group_0": quant_scheme}, ignore=["lm_head"],
            kv_cache_scheme=kv_scheme if kv_scales else None), show_progress=False)
        for name, amax in kv_amax.items():
            model.get_parameter(name).data.fill_(2 * amax / 448)
        for module in model.modules():
            if getattr(getattr(module, "quantization_scheme", None), "weights", None) is not None:
                w = module.weight.detach()
                scale, zp = calculate_qparams(w.amin(1, keepdim=True).clamp(max=0),
                                              w.amax(1, keepdim=True).clamp(min=0),
                                              module.quantization_scheme.weights)
                module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
                if hasattr(module, "weight_zero_point"):
                    zero = module.weight_zero_point
                    zero.data.copy_(zp.reshape(zero.shape))
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        path = Path(path)
        model.save_pretrained(path)
        compressor.update_config(str(path))
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy(Path(src) / name, path / name)
    return path


def _kv_amax(model: torch.nn.Module) -> dict[str, float]:
    """``<attention>.k_scale``/``v_scale`` -> the largest |output| of its k_proj/v_proj over a
    forward of 32 token ids."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        for proj, scale in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            if name.endswith(f".{proj}"):
                key = f"{name.rsplit('.', 1)[0]}.{scale}"
                hooks.append(module.register_forward_hook(
                    lambda m, i, out, key=key: amax.__setitem__(key, out.abs().max().item())))
    with torch.no_grad():
        model(torch.arange(1, 33)[None])
    for h in hooks:
        h.remove()
    return amax


@contextlib.contextmanager
def _attention_recognised(on: bool) -> Iterator[None]:
    """compressed-tensors 0.20 finds attention layers by a ``past_key_values`` parameter of
    their forward, which transformers 5 renamed ``cache``: recognise them by their k/v
    projections while the KV scheme is applied, so the library writes the scales itself."""
    if not on:
        yield
        return
    from compressed_tensors.quantization.lifecycle import apply, initialize

    original = initialize.is_cached_attention_module

    def recognised(module: torch.nn.Module) -> bool:
        return initialize._is_attention_module(module) and hasattr(module, "k_proj")

    apply.is_cached_attention_module = initialize.is_cached_attention_module = recognised
    try:
        yield
    finally:
        apply.is_cached_attention_module = initialize.is_cached_attention_module = original
