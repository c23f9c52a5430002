"""Qwen3 (dense): the Llama decoder with ``qk_norm`` (q_norm, k_norm: per-head RMSNorm of q
and k, applied after the projection and before the rotary embedding) and an explicit
``head_dim`` (num_heads * head_dim may differ from hidden_size); biases on q/k/v/o only with
``attention_bias``."""

from __future__ import annotations

from typing import ClassVar

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm: ClassVar[bool] = True
