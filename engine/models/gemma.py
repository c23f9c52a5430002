"""Gemma 2 and Gemma 3 (text) decoders: GeGLU MLP, Gemma's ``1 + weight`` RMSNorm around both
the attention and the MLP (four norms a layer), embeddings scaled by sqrt(hidden_size), softmax
scale ``query_pre_attn_scalar ** -0.5``, and layers alternating sliding-window (local) and global
attention (``engine.models.layer_types``). Gemma 2 soft-caps the attention scores and the final
logits; Gemma 3 RMS-normalises each head of q and k and rotates local layers with their own
base frequency (``rope_local_base_freq``), global ones with ``rope_theta`` and its scaling.
The configuration's defaults, where config.json leaves a field out, are HF's."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from engine.layers.activation import GeluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
)
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.hf_config import HFConfig
from engine.models.layer_types import check_layer_types, set_sliding_windows, sliding_windows
from engine.models.llama import LlamaAttention, LlamaMLP
from engine.models.registry import CausalLM

Rope = tuple[float, dict[str, Any]]  # (base frequency, rope parameters)
ROPE_TYPES = ("default", "linear", "llama3")


class GemmaAttention(LlamaAttention):
    """Llama's attention (its ``forward``) with Gemma's parts: ``1 + w`` q/k norms, the layer's
    own rope, the ``query_pre_attn_scalar`` scale and the scores' soft-cap."""

    def __init__(self, cfg: HFConfig, rope: Rope, softcap: float | None, qk_norm: bool):
        nn.Module.__init__(self)  # every part is built here, none as Llama builds it
        bias = bool(cfg.raw.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                                          cfg.num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.head_dim = cfg.head_dim
        self.q_size = self.qkv_proj.num_heads * cfg.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * cfg.head_dim
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.max_position, *rope)
        scale = float(cfg.raw.get("query_pre_attn_scalar", 256)) ** -0.5
        self.attn = Attention(self.qkv_proj.num_heads, cfg.head_dim, self.qkv_proj.num_kv_heads,
                              scale, softcap=softcap)



class GemmaMLP(LlamaMLP):
    """Llama's MLP with GeGLU (gelu, tanh approximation) for SiLU."""

    def __init__(self, cfg: HFConfig):
        super().__init__(cfg)
        self.act = GeluAndMul()  # type: ignore[assignment]
        self.gate_up_proj.gated_silu = False  # the C kernel's fused product applies SiLU only


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: HFConfig, rope: Rope, softcap: float | None, qk_norm: bool):
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(cfg, rope, softcap, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x.clone()
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, cfg: HFConfig, ropes: list[Rope], windows: list[int],
                 softcap: float | None, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.normalizer = cfg.hidden_size**0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, rope, softcap, qk_norm)
                                    for rope in ropes)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        set_sliding_windows(self.layers, windows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)  # rounded to the dtype, as HF
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2; Gemma 3 (text) below. Weight names and packing are Llama's; the embeddings are
    tied unless config.json says otherwise."""

    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    pattern: ClassVar[int] = 2  # every 2nd layer global when config.json lists no layer_types
    defaults: ClassVar[dict[str, Any]] = {"attn_logit_softcapping": 50.0,
                                          "final_logit_softcapping": 30.0}
    qk_norm = False

    def __init__(self, cfg: HFConfig):
        super().__init__(cfg)
        cfg.tie_word_embeddings = bool(cfg.raw.get("tie_word_embeddings", True))
        raw = {**self.defaults, **cfg.raw}
        windows = sliding_windows(cfg, self._pattern(raw), window=4096)
        ropes = [self.rope(cfg, window > 0) for window in windows]
        self.final_softcap = raw["final_logit_softcapping"]
        self.model = GemmaModel(cfg, ropes, windows, raw["attn_logit_softcapping"],
                                self.qk_norm)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def _pattern(cls, raw: dict[str, Any]) -> int:
        return cls.pattern

    @classmethod
    def rope(cls, cfg: HFConfig, local: bool) -> Rope:
        return cfg.rope_theta, cfg.rope

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{where}: hidden_activation {act!r} is not supported "
                             "(supported: gelu_pytorch_tanh)")
        check_layer_types(raw, where)
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping",
                     "final_logit_softcapping"):
            value = raw.get(name)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{where}: {name} must be a positive number or null, "
                                 f"got {value!r}")

    def pack_weights(self) -> None:
        """After loading: prepack the matmul weights, keep the norms' 1 + weight."""
        super().pack_weights()
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.prepare()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is not None and self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text: q/k norms, no soft caps by default, local layers' own rope, every
    ``sliding_window_pattern``-th (default 6th) layer global."""

    defaults: ClassVar[dict[str, Any]] = {"attn_logit_softcapping": None,
                                          "final_logit_softcapping": None}
    qk_norm = True

    @classmethod
    def _pattern(cls, raw: dict[str, Any]) -> int:
        return int(raw.get("sliding_window_pattern", 6))

    @classmethod
    def rope(cls, cfg: HFConfig, local: bool) -> Rope:
        return gemma3_ropes(cfg.raw)[local]

    @classmethod
    def check_config(cls, raw: dict[str, Any], where: str) -> None:
        super().check_config(raw, where)
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"{where}: use_bidirectional_attention=true is not supported")
        pattern = raw.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"{where}: sliding_window_pattern must be a positive integer, "
                             f"got {pattern!r}")
        for local, (theta, rope) in enumerate(gemma3_ropes(raw)):
            kind = rope.get("rope_type", rope.get("type", "default"))
            name = "sliding_attention" if local else "full_attention"
            if kind not in ROPE_TYPES:
                raise ValueError(f"{where}: rope type {kind!r} ({name} layers) is not "
                                 f"supported; supported: {', '.join(ROPE_TYPES)}")
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
                raise ValueError(f"{where}: rope_theta of {name} layers must be a positive "
                                 f"number, got {theta!r}")


def gemma3_ropes(raw: dict[str, Any]) -> tuple[Rope, Rope]:
    """(global, local) layers' rope: ``rope_parameters`` keyed by layer type (transformers 5),
    or the older ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & params.keys():
        full: dict[str, Any] = dict(params.get("full_attention") or {})
        local: dict[str, Any] = dict(params.get("sliding_attention") or {})
        return ((full.get("rope_theta", raw.get("rope_theta", 1_000_000.0)), full),
                (local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0)), local))
    full = dict(raw.get("rope_scaling") or params or {})
    theta: float = raw["rope_theta"] if "rope_theta" in raw else full.get("rope_theta", 1e6)
    return (theta, full), (raw.get("rope_local_base_freq", 10_000.0), {})
