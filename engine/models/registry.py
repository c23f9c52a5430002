"""What a model class is (``CausalLM``), and the model class for an architecture."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from engine.layers.embedding import ParallelLMHead
from engine.layers.linear import LinearBase
from engine.layers.quantization import quantize_linears
from engine.loader import ShardId
from engine.models.architectures import architecture_class

if TYPE_CHECKING:
    from engine.models.hf_config import HFConfig


class CausalLM(nn.Module):
    """What the model runner relies on in a model class, built as ``cls(hf_config)``.

    ``forward(input_ids [T], positions [T]) -> hidden [T, H]`` reads the step's attention
    metadata from ``engine.layers.context``; ``compute_logits(hidden [N, H])`` returns the logits
    [N, vocab] on tensor-parallel rank 0 and None on the other ranks; ``pack_weights()`` runs
    once, after ``engine.loader.load_weights`` (and ``quantize_weights`` when quantizing), which
    reads ``packed_modules_mapping`` (checkpoint name part -> (fused module, shard id)).

    The methods here serve the usual layout, which a subclass builds in ``__init__``: ``model``
    (the decoder, with ``embed_tokens``) and ``lm_head`` (tied to the embedding or not).
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, ShardId]]] = {}

    if TYPE_CHECKING:  # nn.Module.__call__ runs forward (and its hooks); typed like forward

        def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor: ...

        model: Any  # the decoder: (input_ids, positions) -> hidden; has embed_tokens
        lm_head: ParallelLMHead

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
        hidden: torch.Tensor = self.model(input_ids, positions)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits: torch.Tensor | None = self.lm_head(hidden)
        return logits

    def pack_weights(self) -> None:
        """After loading: let every matmul layer prepack its weight for the device."""
        for m in self.modules():
            if isinstance(m, LinearBase):
                m.pack_weights()
        self.lm_head.pack_weights(tied=self.cfg.tie_word_embeddings)

    def quantize_weights(self, method: str) -> None:
        """After loading, before ``pack_weights``: keep the weights in ``method``'s format
        (``ModelConfig.quantization``): the linear layers; with int8 the embedding and the LM
        head too (FP8 leaves them in dtype, as vLLM does)."""
        quantize_linears(self, method)
        if method != "int8":
            return
        self.model.embed_tokens.quantize()
        if self.cfg.tie_word_embeddings:  # the same parameter, already int8
            self.lm_head.weight_scale = self.model.embed_tokens.weight_scale
            self.lm_head.dtype = self.model.embed_tokens.dtype
        else:
            self.lm_head.quantize()


def model_class(arch: str) -> type[CausalLM]:
    """The model class registered for ``arch`` (one that ``check_architecture`` accepted)."""
    cls: type[CausalLM] = architecture_class(arch)
    return cls
