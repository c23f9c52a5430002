"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama decoder, with the checkpoint's q, k and v fused in
one ``qkv_proj`` tensor and gate and up in one ``gate_up_proj`` (``QKVParallelLinear`` and
``MergedColumnParallelLinear`` load them with shard id None, each tensor-parallel rank reading
its own rows of each part), LongRoPE scaling (``engine.layers.rotary``) and, in Phi-4-mini, a
``partial_rotary_factor``. No biases: ``attention_bias`` and ``mlp_bias`` are refused."""

from __future__ import annotations

from typing import Any, ClassVar

from engine.loader import ShardId
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's names are the fused modules' own: no part mapping.
    packed_modules_mapping: ClassVar[dict[str, tuple[str, ShardId]]] = {}

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        super().check_config(raw, where)
        if raw.get("attention_bias"):
            raise ValueError(f"{where}: attention_bias=true is not supported for "
                             "Phi3ForCausalLM (its projections have no biases)")
