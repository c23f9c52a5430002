"""Mixture-of-experts models (engine/models/mixtral.py, engine/layers/moe.py) beyond HF parity
(tests/engine/test_model_parity.py): routing rules, experts' weights stacked and split per
rank, tensor parallelism against one rank, and what is refused with its reason."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as tmp
from safetensors.torch import load_file

from engine import LLM
from engine.distributed import Rendezvous, destroy_tp_group, init_tp_group, open_store
from engine.layers.moe import select_experts
from tests.checkpoints import make_checkpoint
from tests.engine.test_tensor_parallel import (
    ENGINE,
    assert_logprobs_close,
    generate,
    rank_children,
)

CHECKPOINTS = {
    "mixtral": dict(arch="mixtral"),
    # dense layer 0 (mlp_only_layers), renormalised top-k
    "qwen3_moe": dict(arch="qwen3_moe", norm_topk_prob=True, mlp_only_layers=[0]),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: make_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


def test_select_experts_softmax_top_k_and_renormalisation():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.3, 0.15, 0.45, 0.1]]))
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 3], [2, 0]]
    torch.testing.assert_close(weights, torch.tensor([[0.4, 0.3], [0.45, 0.3]]))
    weights, ids = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.tensor([[4 / 7, 3 / 7], [0.6, 0.4]]))
    assert weights.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_tp2_matches_tp1(ckpts, name):
    ref = generate(LLM(str(ckpts[name]), **ENGINE))
    llm = LLM(str(ckpts[name]), tensor_parallel_size=2, **ENGINE)
    got = generate(llm)
    assert_logprobs_close(ref, got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert len(set(got[1].outputs[0].token_ids)) > 4  # not a degenerate model
    del llm
    gc.collect()
    assert rank_children() == []


def _check_expert_shards(rank: int, store_path: str, paths: list[str]) -> None:
    """Per rank of 2: every expert's gate and up rows and down columns of this rank, stacked."""
    from engine.loader import load_weights
    from engine.models.hf_config import HFConfig
    from engine.models.registry import model_class

    init_tp_group(open_store(store_path, 2), rank, 2, torch.device("cpu"))
    try:
        for path in paths:
            hf = HFConfig.load(path)
            model = model_class(hf.architecture)(hf)
            load_weights(model, path, progress=False)
            full = load_file(Path(path) / "model.safetensors")
            params = dict(model.named_parameters())
            mixtral = hf.architecture == "MixtralForCausalLM"
            block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if mixtral
                                       else ("mlp", ("gate_proj", "up_proj", "down_proj")))
            layer = f"model.layers.1.{block}"
            for e in range(4):
                w = {p: full[f"{layer}.experts.{e}.{p}.weight"] for p in (gate, up, down)}
                want13 = torch.cat([w[gate].chunk(2)[rank], w[up].chunk(2)[rank]])
                assert torch.equal(params[f"{layer}.experts.w13.weight"][e], want13)
                want2 = w[down].chunk(2, dim=1)[rank]
                assert torch.equal(params[f"{layer}.experts.w2.weight"][e], want2)
            assert torch.equal(params[f"{layer}.gate.weight"], full[f"{layer}.gate.weight"])
    finally:
        destroy_tp_group()


def test_each_rank_stacks_its_half_of_every_expert(ckpts):
    rendezvous = Rendezvous()
    try:
        tmp.spawn(_check_expert_shards, args=(rendezvous.path, [str(p) for p in ckpts.values()]),
                  nprocs=2, join=True)
    finally:
        rendezvous.close()


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_is_refused(ckpts, method):
    with pytest.raises(ValueError, match=f"quantization='{method}' is not supported for "
                       "mixture-of-experts models \\(MixtralForCausalLM\\)"):
        LLM(str(ckpts["mixtral"]), quantization=method, **ENGINE)


def _with_config(tmp_path: Path, src: Path, **changes) -> Path:
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    cfg = json.loads((src / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("name, changes, message", [
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok must be an integer 1..4, got 5"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be an integer >= 1, got 0"),
    ("qwen3_moe", {"mlp_only_layers": "0"}, "mlp_only_layers must be a list of layer indices"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1"),
    ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size must be an integer"),
    ("mixtral", {"quantization_config": {"quant_method": "compressed-tensors"}},
     "quantized checkpoints of mixture-of-experts models are not supported"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path, ckpts, name, changes, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(_with_config(tmp_path, ckpts[name], **changes)), **ENGINE)


def test_a_missing_expert_tensor_is_named(tmp_path, ckpts):
    from safetensors.torch import save_file

    src = ckpts["mixtral"]
    weights = load_file(src / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).symlink_to(f)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint is missing tensors: model.layers.1."
                       "block_sparse_moe.experts.w13.weight part 3/1"):
        LLM(str(tmp_path), **ENGINE)


def test_expert_intermediate_size_must_split_across_ranks(tmp_path, ckpts):
    path = _with_config(tmp_path, ckpts["qwen3_moe"], moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"expert intermediate size \(33\) is not divisible "
                       r"by tensor_parallel_size \(2\)"):
        LLM(str(path), tensor_parallel_size=2, **ENGINE)
    assert rank_children() == []
