"""Maps ``architectures`` in config.json to model classes."""

from __future__ import annotations

from torch import nn

_MODELS = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(archs: object, where: str = "config.json") -> str:
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{where}: 'architectures' is missing; supported: "
                         f"{', '.join(supported_architectures())}")
    for arch in archs:
        if arch in _MODELS:
            return arch
    raise ValueError(f"{where}: architecture {', '.join(map(str, archs))} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def model_class(arch: str) -> type[nn.Module]:
    module_name, cls_name = _MODELS[arch].split(":")
    module = __import__(module_name, fromlist=[cls_name])
    return getattr(module, cls_name)
