"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE. Each is the Llama decoder (Qwen3-MoE with
Qwen3's per-head q/k RMSNorm) whose MLP is a ``FusedMoE``: top-k of E experts per token.

- Mixtral (``MixtralForCausalLM``): ``block_sparse_moe`` with experts' ``w1`` (gate), ``w3``
  (up), ``w2`` (down) of ``intermediate_size``; softmax over all experts, top-k, renormalised.
- Qwen3-MoE (``Qwen3MoeForCausalLM``): ``mlp`` with experts' ``gate_proj``, ``up_proj``,
  ``down_proj`` of ``moe_intermediate_size``; top-k renormalised only with ``norm_topk_prob``.
  Layers in ``mlp_only_layers``, or not on the ``decoder_sparse_step``, have a dense MLP of
  ``intermediate_size``, as in transformers.

Quantization (``quantization=int8|fp8``, quantized checkpoints) is refused: the experts'
stacked weights have no quantized path.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.moe import FusedMoE, expert_mapping
from engine.layers.norm import RMSNorm
from engine.loader import ShardId
from engine.models.hf_config import HFConfig
from engine.models.layer_types import set_sliding_windows, sliding_windows
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.models.registry import CausalLM

_ATTENTION_MAPPING: dict[str, tuple[str, ShardId]] = {
    "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
_DENSE_MAPPING: dict[str, tuple[str, ShardId]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _int_field(raw: dict[str, Any], name: str, where: str, low: int = 1,
               high: int | None = None) -> int:
    value = raw.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{where}: {name} must be an integer {bound}, got {value!r}")
    return value


class MoEDecoderLayer(nn.Module):
    """Attention, then the feed-forward of the subclass (``feed_forward``); ``layer``: its
    index (Qwen3-MoE's dense layers)."""

    def __init__(self, cfg: HFConfig, layer: int, qk_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x.clone()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.feed_forward(x), residual


class MixtralDecoderLayer(MoEDecoderLayer):
    def __init__(self, cfg: HFConfig, layer: int):
        super().__init__(cfg, layer)
        self.block_sparse_moe = FusedMoE(cfg.raw["num_local_experts"],
                                         cfg.raw["num_experts_per_tok"], cfg.hidden_size,
                                         cfg.intermediate_size, renormalize=True)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block_sparse_moe(x)
        return out


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    def __init__(self, cfg: HFConfig, layer: int):
        super().__init__(cfg, layer, qk_norm=True)
        raw = cfg.raw
        self.mlp: nn.Module
        if Qwen3MoeForCausalLM.is_sparse(raw, layer):
            self.mlp = FusedMoE(Qwen3MoeForCausalLM.num_experts(raw), raw["num_experts_per_tok"],
                                cfg.hidden_size, raw["moe_intermediate_size"],
                                renormalize=bool(raw.get("norm_topk_prob", False)))
        else:
            self.mlp = LlamaMLP(cfg)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x)
        return out


class MoEModel(nn.Module):
    def __init__(self, cfg: HFConfig, layer_class: type[MoEDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        set_sliding_windows(self.layers, sliding_windows(cfg))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class MoECausalLM(CausalLM):
    """The decoder with ``layer_class`` layers; ``expert_names``: the experts' gate, up and
    down checkpoint names."""

    layer_class: ClassVar[type[MoEDecoderLayer]]
    expert_names: ClassVar[tuple[str, str, str]]

    def __init__(self, cfg: HFConfig):
        super().__init__(cfg)
        # per instance: the expert count comes from config.json; expert names first, so that
        # Qwen3-MoE's experts' gate_proj does not take the dense mapping
        self.packed_modules_mapping = {  # type: ignore[misc]
            **expert_mapping(self.num_experts(cfg.raw), *self.expert_names),
            **_ATTENTION_MAPPING, **_DENSE_MAPPING}
        self.model = MoEModel(cfg, self.layer_class)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def num_experts(cls, raw: dict[str, Any]) -> int:
        value: int = raw["num_local_experts"]
        return value

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        LlamaForCausalLM.check_config(raw, where)
        if raw.get("quantization_config"):
            raise ValueError(f"{where}: quantized checkpoints of mixture-of-experts models are "
                             "not supported (the experts' weights have no quantized path)")
        _int_field(raw, "num_experts_per_tok", where, high=cls.num_experts(raw))

    def quantize_weights(self, method: str) -> None:
        raise ValueError(f"quantization={method!r} is not supported for mixture-of-experts "
                         f"models ({self.cfg.architecture}): the experts' weights have no "
                         "quantized path; load it unquantized")

    # pack_weights (CausalLM's): the attention's, dense MLPs' and routers' matmuls prepacked;
    # the experts' stacked weights stay as they are


class MixtralForCausalLM(MoECausalLM):
    layer_class = MixtralDecoderLayer
    expert_names = ("w1", "w3", "w2")

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        _int_field(raw, "num_local_experts", where)
        super().check_config(raw, where)


class Qwen3MoeForCausalLM(MoECausalLM):
    layer_class = Qwen3MoeDecoderLayer
    expert_names = ("gate_proj", "up_proj", "down_proj")

    @classmethod
    def num_experts(cls, raw: dict[str, Any]) -> int:
        value: int = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        return value

    @classmethod
    def is_sparse(cls, raw: dict[str, Any], layer: int) -> bool:
        """As transformers: an MoE layer unless in ``mlp_only_layers`` or off the
        ``decoder_sparse_step``."""
        return (layer not in raw.get("mlp_only_layers", [])
                and (layer + 1) % raw.get("decoder_sparse_step", 1) == 0)

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        _int_field(raw, "num_experts" if "num_experts" in raw else "num_local_experts", where)
        _int_field(raw, "moe_intermediate_size", where)
        if "decoder_sparse_step" in raw:
            _int_field(raw, "decoder_sparse_step", where)
        only = raw.get("mlp_only_layers", [])
        if not isinstance(only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise ValueError(f"{where}: mlp_only_layers must be a list of layer indices, got "
                             f"{only!r}")
        super().check_config(raw, where)
