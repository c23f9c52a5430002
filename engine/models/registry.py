"""Maps ``architectures`` in config.json to model classes, and states what a model class is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from engine.loader import ShardId

if TYPE_CHECKING:
    from engine.models.hf_config import HFConfig

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


class CausalLM(nn.Module):
    """What the model runner relies on in a model class, built as ``cls(hf_config)``.

    ``forward(input_ids [T], positions [T]) -> hidden [T, H]`` reads the step's attention
    metadata from ``engine.context``; ``compute_logits(hidden [N, H])`` returns the logits
    [N, vocab] on tensor-parallel rank 0 and None on the other ranks; ``pack_weights()`` runs
    once, after ``engine.loader.load_weights`` (and ``quantize_weights`` when quantizing), which reads ``packed_modules_mapping``
    (checkpoint name part -> (fused module, shard id)).
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ShardId]]] = {}

    if TYPE_CHECKING:  # nn.Module.__call__ runs forward (and its hooks); typed like forward

        def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

    def __init__(self, cfg: HFConfig):
        super().__init__()
        self.cfg = cfg

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        """Refuse, with ``ValueError`` naming the field, what this class cannot build from
        ``config.json`` (``raw``); the fields every architecture shares are checked before."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported "
                             "(supported: silu)")
        if raw.get("mlp_bias"):
            raise ValueError(f"{where}: mlp_bias=true is not supported")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        raise NotImplementedError

    def pack_weights(self) -> None:
        raise NotImplementedError

    def quantize_weights(self, method: str) -> None:
        """After loading, before ``pack_weights``: keep the weights in ``method``'s format
        (``ModelConfig.quantization``)."""
        raise NotImplementedError


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def check_architecture(archs: object, where: str = "config.json") -> str:
    if not isinstance(archs, list) or not archs:
        raise ValueError(f"{where}: 'architectures' is missing; supported: "
                         f"{', '.join(supported_architectures())}")
    for arch in archs:
        if isinstance(arch, str) and arch in _MODELS:
            return arch
    raise ValueError(f"{where}: architecture {', '.join(map(str, archs))} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def model_class(arch: str) -> type[CausalLM]:
    module_name, cls_name = _MODELS[arch].split(":")
    module = __import__(module_name, fromlist=[cls_name])
    cls: type[CausalLM] = getattr(module, cls_name)
    return cls
