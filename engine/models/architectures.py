"""The architectures the engine serves: ``architectures`` in config.json -> the model class's
module and name. The modules are imported when a class is asked for, so that reading a
config.json (``hf_config``) does not import every model."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS = {
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "Gemma2ForCausalLM": "engine.models.gemma:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "engine.models.gemma:Gemma3ForCausalLM",
    "Qwen3ForCausalLM": "engine.models.qwen3:Qwen3ForCausalLM",
    "Phi3ForCausalLM": "engine.models.phi3:Phi3ForCausalLM",
    "MixtralForCausalLM": "engine.models.mixtral:MixtralForCausalLM",
    "Qwen3MoeForCausalLM": "engine.models.mixtral:Qwen3MoeForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(archs: object, where: str = "config.json") -> str:
    """The first of ``archs`` that the engine serves (``ValueError`` naming the supported ones)."""
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{where}: 'architectures' is missing; supported: "
                         f"{', '.join(supported_architectures())}")
    for arch in archs:
        if isinstance(arch, str) and arch in _MODELS:
            return arch
    raise ValueError(f"{where}: architecture {', '.join(map(str, archs))} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def architecture_class(arch: str) -> Any:
    """The class registered for ``arch``, its module imported now (``registry.model_class``
    gives it its type)."""
    module_name, cls_name = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
