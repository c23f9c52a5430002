"""Mixture-of-experts MLP layer: a router picks each token's top-k experts, the experts' gated
SiLU MLPs run as one fused, grouped computation (``ops.fused_moe``) and their outputs are summed
with the routing weights.

The experts' checkpoint weights (one [I, H] gate, up and [H, I] down tensor per expert) are
stacked at load into ``w13`` [E, 2*I, H] (gate rows, then up rows) and ``w2`` [E, H, I]. Tensor
parallelism splits every expert's intermediate dimension, as vLLM does: gate/up by rows
(column-parallel), down by columns (row-parallel), one all-reduce after the weighted sum. The
router's weight is replicated.

Shard ids (``packed_modules_mapping``, see ``expert_mapping``): ``"<expert>/<0 gate | 1 up>"``
for ``w13``, the expert index for ``w2``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed import all_reduce, divide, tp_rank, tp_size
from engine.layers.linear import ReplicatedLinear
from engine.loader import Loaded, ShardId, as_tensor, set_weight_loader, shard
from kernels import ops


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (in float32), the top ``top_k``, their weights renormalised to
    sum to one when ``renormalize`` (Mixtral always; Qwen3-MoE with ``norm_topk_prob``).
    Returns (weights [T, K] float32, expert ids [T, K] int64)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_mapping(num_experts: int, gate: str, up: str,
                   down: str) -> dict[str, tuple[str, ShardId]]:
    """``packed_modules_mapping`` entries for the experts' checkpoint names
    (``experts.<e>.<gate|up|down>``; Mixtral: w1, w3, w2; Qwen3-MoE: gate_proj, up_proj,
    down_proj) -> the stacked ``experts.w13`` / ``experts.w2`` and their shard ids."""
    mapping: dict[str, tuple[str, ShardId]] = {}
    for e in range(num_experts):
        mapping[f"experts.{e}.{gate}"] = ("experts.w13", f"{e}/0")
        mapping[f"experts.{e}.{up}"] = ("experts.w13", f"{e}/1")
        mapping[f"experts.{e}.{down}"] = ("experts.w2", e)
    return mapping


def _copy_part(target: torch.Tensor, part: Loaded, what: str) -> None:
    if target.shape != part.shape:
        raise ValueError(f"{what}: expected shape {tuple(target.shape)}, checkpoint gives "
                         f"{tuple(part.shape)}")
    target.copy_(as_tensor(part))


class ExpertWeights(nn.Module):
    """One stacked projection of every expert: ``weight`` [E, out, in] (this rank's shard).
    ``gate_up``: out = 2 * I/tp (gate rows, then up rows), the checkpoint's [I, H] split by
    rows; else (down): in = I/tp, the checkpoint's [H, I] split by columns."""

    def __init__(self, num_experts: int, out_features: int, in_features: int, gate_up: bool):
        super().__init__()
        self.gate_up = gate_up
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features),
                                   requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        if self.gate_up:
            expert, part = (int(i) for i in str(shard_id).split("/"))
            size = param.shape[1] // 2
            target = param.data[expert].narrow(0, part * size, size)
            what = f"expert {expert} {('gate', 'up')[part]}"
            _copy_part(target, shard(loaded, 0, tp_rank(), tp_size(), size, what), what)
        else:
            expert = int(str(shard_id))
            size, what = param.shape[2], f"expert {expert} down"
            _copy_part(param.data[expert], shard(loaded, 1, tp_rank(), tp_size(), size, what),
                       what)


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.w13 = ExpertWeights(num_experts, 2 * inter, hidden, gate_up=True)
        self.w2 = ExpertWeights(num_experts, hidden, inter, gate_up=False)


class FusedMoE(nn.Module):
    """x [T, H] -> [T, H]: ``gate`` (the router, [E, H]) picks ``top_k`` of ``num_experts``
    experts per token; ``experts.w13`` / ``experts.w2`` hold their stacked weights."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        inter = divide(intermediate, tp_size(), "expert intermediate size")
        self.gate = ReplicatedLinear(hidden, num_experts)
        self.experts = Experts(num_experts, hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        w13, w2 = self.experts.w13.weight, self.experts.w2.weight
        y = ops.fused_moe(x, w13, w2, weights, ids)
        if tp_size() > 1:
            all_reduce(y)
        return y
