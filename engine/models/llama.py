"""Llama-family decoder (Llama 2/3, Mistral, Qwen2; Qwen3 and Phi-3 subclass it): RMSNorm,
GQA attention with rotary embeddings, gated SiLU MLP. The architectures differ only in flags
read from config.json (qkv bias for Qwen2, tied embeddings, rope scaling, partial rotary) and
``qk_norm`` (Qwen3's per-head RMSNorm of q and k before the rotary embedding)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import (
    RotaryEmbedding,
    check_rope_config,
    longrope_params,
    rope_kind,
    rotary_dim,
)
from engine.models.hf_config import HFConfig
from engine.models.layer_types import set_sliding_windows, sliding_windows
from engine.models.registry import CausalLM


def rotary_embedding(cfg: HFConfig) -> RotaryEmbedding:
    """The rotary embedding ``cfg`` asks for (LongRoPE resolved by ``longrope_params``)."""
    rope = cfg.rope
    if rope_kind(rope) == "longrope":
        rope = longrope_params(rope, cfg.raw, cfg.max_position, cfg.max_model_len)
    return RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, rope,
                           rotary_dim(cfg.head_dim, cfg.raw, cfg.rope))

class LlamaAttention(nn.Module):
    """``qk_norm``: each head of q and k RMS-normalised (weights ``q_norm``, ``k_norm`` of
    size head_dim) after the projection, before the rotary embedding (Qwen3)."""

    def __init__(self, cfg: HFConfig, qk_norm: bool = False):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=cfg.o_bias)
        self.q_size = self.qkv_proj.num_heads * cfg.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * cfg.head_dim
        self.head_dim = cfg.head_dim
        self.q_norm: nn.Module | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm: nn.Module | None = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_embedding(cfg)
        self.attn = Attention(self.qkv_proj.num_heads, cfg.head_dim,
                              self.qkv_proj.num_kv_heads, cfg.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # Views into the qkv product, rows strided: the kernels take row strides.
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        self.rotary_emb(positions, q, k)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v))
        return out


class LlamaMLP(nn.Module):
    def __init__(self, cfg: HFConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size])
        self.gate_up_proj.gated_silu = True  # the C dense kernel may apply the activation
        self.down_proj = RowParallelLinear(size, cfg.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        out: torch.Tensor = self.down_proj(h if self.gate_up_proj.activated else self.act(h))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: HFConfig, qk_norm: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x.clone()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: HFConfig, qk_norm: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, qk_norm)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        set_sliding_windows(self.layers, sliding_windows(cfg))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(CausalLM):
    # checkpoint name part -> (our packed module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    qk_norm: ClassVar[bool] = False  # per-head RMSNorm of q and k (``LlamaAttention``)

    def __init__(self, cfg: HFConfig):
        super().__init__(cfg)
        self.model = LlamaModel(cfg, self.qk_norm)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        super().check_config(raw, where)
        heads = raw["num_attention_heads"]
        check_rope_config(raw, raw.get("head_dim") or raw["hidden_size"] // heads, where)

