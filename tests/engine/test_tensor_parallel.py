"""Tensor parallelism on the CPU (gloo): TP=2 against TP=1, sharded loading, start-up errors,
and rank processes that never outlive rank 0."""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.multiprocessing as tmp
from safetensors.torch import load_file

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.distributed import (
    Rendezvous,
    check_tp_sizes,
    destroy_tp_group,
    init_tp_group,
    open_store,
)
from engine.executor.tp_ranks import check_device_count
from engine.llm_engine import TensorParallelError
from tests.checkpoints import make_checkpoint, make_compressed_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CHECKPOINTS = {
    "llama": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),  # q/k/v biases
    "llama-kv1": dict(arch="llama", num_key_value_heads=1),  # KV head replicated on 2 ranks
    # fused qkv_proj and gate_up_proj, each rank reading its rows of each part
    "phi3-kv1": dict(arch="phi3", num_key_value_heads=1, partial_rotary_factor=0.75),
}
PROMPTS = [[0, 17, 230, 455, 12], [0, *range(100, 160)], [3], [0, 5, 600, 601, 33, 42, 99, 7]]
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8,
              max_num_batched_tokens=32, num_threads=1)  # 32: the long prompt is chunked
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {name: make_checkpoint(root / name, **kw) for name, kw in CHECKPOINTS.items()}


def rank_children() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedserve-tp")]


def generate(llm: LLM):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)


def assert_logprobs_close(ref, got, tol: float = 1e-4) -> None:
    """Same greedy tokens, or at the first divergence each side's token is in the other's top-5;
    logprobs close (within ``tol``) up to there."""
    for r, g in zip(ref, got, strict=True):
        r, g = r.outputs[0], g.outputs[0]
        for step, (rt, gt) in enumerate(zip(r.token_ids, g.token_ids, strict=True)):
            rl, gl = r.logprobs[step], g.logprobs[step]
            for token in set(rl) & set(gl):
                assert gl[token] == pytest.approx(rl[token], abs=tol)
            if rt != gt:
                assert rt in gl and gt in rl, f"step {step}: {rt} vs {gt}"
                break


# ---- results ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_tp2_matches_tp1(ckpts, name):
    ref = generate(LLM(str(ckpts[name]), **ENGINE))
    llm = LLM(str(ckpts[name]), tensor_parallel_size=2, **ENGINE)
    assert len(rank_children()) == 1
    got = generate(llm)
    assert_logprobs_close(ref, got)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert len(set(got[1].outputs[0].token_ids)) > 4  # not a degenerate model
    del llm  # the engine's finaliser sends the exit message and joins the rank
    gc.collect()
    assert rank_children() == []


def test_tp2_structured_output_matches_tp1(ckpts):
    """The grammar masks rank 0's logits (the sampler is rank 0's): same tokens as one rank."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "tags": {"type": "array", "items": {"enum": [
                                                   "a", "b"]}, "minItems": 2, "maxItems": 6}},
              "required": ["n", "tags"], "additionalProperties": False}
    params = SamplingParams(max_tokens=60, temperature=0.0, n=2, seed=0,
                            structured_outputs=StructuredOutputsParams(json=schema))
    inputs = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM(str(ckpts["llama"]), **ENGINE).generate(inputs, params, use_tqdm=False)
    llm = LLM(str(ckpts["llama"]), tensor_parallel_size=2, **ENGINE)
    got = llm.generate(inputs, params, use_tqdm=False)
    for r, g in zip(ref, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        for c in g.outputs:
            jsonschema.validate(json.loads(c.text), schema)
    del llm
    gc.collect()


@pytest.mark.parametrize("scheme", ["int8", "fp8+fp8-kv", "int8-w8a16", "fp8-w8a8"])
def test_tp2_quantized_close_to_tp1(ckpts, scheme, tmp_path):
    """Quantized weights shard with their scales. Not bit-equal to one rank: a row-parallel
    layer's activations are quantized per rank over their half of the inputs (and load-time
    int8 takes its scales over each rank's half). Each side's rounding moves a logprob by
    about 0.1 nats (int8 against float32: mean KL 0.004), so the two differ by up to 0.2 over
    the 320 compared here (measured 0.15-0.21); a scale taken from the wrong rows moves them
    by whole nats."""
    path, extra = ckpts["llama"], {}
    if scheme == "int8":
        extra = {"quantization": "int8"}
    elif scheme == "fp8+fp8-kv":  # each rank stores and reads its own kv heads in fp8
        extra = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    else:
        path = make_compressed_checkpoint(path, tmp_path / scheme, scheme)
    ref = generate(LLM(str(path), **ENGINE, **extra))
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE, **extra)
    assert_logprobs_close(ref, generate(llm), tol=0.35)
    del llm
    gc.collect()
    assert rank_children() == []


# ---- sharded loading -------------------------------------------------------------------------

def expected_shards(full: dict[str, torch.Tensor], cfg: dict, rank: int, tp: int) -> dict:
    """This rank's slice of every weight, computed from the full tensors independently of the
    layers: q/k/v and gate/up packed, KV heads replicated when fewer than ranks."""
    kv_heads = cfg["num_key_value_heads"]
    kv_index, kv_parts = (rank, tp) if kv_heads >= tp else (rank * kv_heads // tp, kv_heads)

    def rows(t, index, parts):
        return t.chunk(parts, dim=0)[index]

    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    sizes = [cfg["num_attention_heads"] * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    for name in [n for n in full if ".qkv_proj." in n or ".gate_up_proj." in n]:  # Phi-3
        fused = full.pop(name)
        if ".qkv_proj." in name:
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), fused.split(sizes)))
        else:
            parts = dict(zip(("gate_proj", "up_proj"), fused.chunk(2)))
        packed = "qkv_proj" if ".qkv_proj." in name else "gate_up_proj"
        full.update({name.replace(packed, part): t for part, t in parts.items()})
    out = {}
    for name, t in full.items():
        base = name.rsplit(".", 1)[0]
        if ".k_proj." in name or ".v_proj." in name:
            continue
        if ".q_proj." in name:
            k, v = (full[name.replace("q_proj", p)] for p in ("k_proj", "v_proj"))
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [rows(t, rank, tp), rows(k, kv_index, kv_parts), rows(v, kv_index, kv_parts)])
        elif ".gate_proj." in name:
            up = full[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [rows(t, rank, tp), rows(up, rank, tp)])
        elif base.endswith(("o_proj", "down_proj")):
            out[name] = t.chunk(tp, dim=1)[rank]
        elif base.endswith(("embed_tokens", "lm_head")):
            out[name] = rows(t, rank, tp)
        elif ".up_proj." not in name:
            out[name] = t  # norms: whole on every rank
    return out


def _check_rank_shards(rank: int, store_path: str, paths: list[str]) -> None:
    """Runs in a spawned process per rank: load each checkpoint as rank ``rank`` of 2 and
    compare every parameter with its expected slice. Full reads of sharded tensors fail."""
    from engine.loader import TensorSlice, load_weights
    from engine.models.hf_config import HFConfig
    from engine.models.registry import model_class

    def no_full_read(self):
        raise AssertionError("a sharded weight was read whole")

    TensorSlice.read = no_full_read
    init_tp_group(open_store(store_path, 2), rank, 2, torch.device("cpu"))
    try:
        for path in paths:
            hf = HFConfig.load(path)
            model = model_class(hf.architecture)(hf)
            load_weights(model, path, progress=False)
            cfg = json.loads((Path(path) / "config.json").read_text())
            expected = expected_shards(load_file(Path(path) / "model.safetensors"), cfg, rank, 2)
            params = dict(model.named_parameters())
            assert sorted(params) == sorted(expected), path
            for name, want in expected.items():
                assert torch.equal(params[name], want), f"{path}: {name} on rank {rank}"
    finally:
        destroy_tp_group()


def test_each_rank_loads_exactly_its_shard(ckpts):
    rendezvous = Rendezvous()  # this process joins no group
    try:
        tmp.spawn(_check_rank_shards, args=(rendezvous.path, [str(p) for p in ckpts.values()]),
                  nprocs=2, join=True)
    finally:
        rendezvous.close()


# ---- start-up errors -------------------------------------------------------------------------

def _config_only(tmp_path: Path, src: Path, **changes) -> Path:
    cfg = json.loads((src / "config.json").read_text()) | changes
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("changes, tp, message", [
    ({}, 3, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    ({"vocab_size": 770}, 4, r"vocab_size \(770\) is not divisible by tensor_parallel_size \(4\)"),
    ({"intermediate_size": 130}, 4,
     r"intermediate_size \(130\) is not divisible by tensor_parallel_size \(4\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, 2,
     r"num_key_value_heads \(3\) is not divisible by tensor_parallel_size \(2\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
      "intermediate_size": 192}, 3,
     r"tensor_parallel_size \(3\) is not a multiple of num_key_value_heads \(2\)"),
])
def test_sizes_that_do_not_divide_fail_before_any_rank_starts(tmp_path, ckpts, changes, tp,
                                                              message):
    path = _config_only(tmp_path, ckpts["llama"], **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), tensor_parallel_size=tp, **ENGINE)
    assert rank_children() == []


def test_fewer_devices_than_ranks_is_a_clear_error():
    check_device_count(2, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=4 needs 4 CUDA devices .* but 2 "
                       "are visible"):
        check_device_count(4, 2)
    check_tp_sizes(4, num_heads=4, num_kv_heads=1, vocab_size=768, intermediate_size=128)


# ---- failures and shutdown -------------------------------------------------------------------

def test_a_dead_rank_fails_the_step_instead_of_hanging(ckpts):
    llm = LLM(str(ckpts["llama"]), tensor_parallel_size=2, **ENGINE)
    (child,) = rank_children()
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    with pytest.raises(TensorParallelError, match="rank 1 .* has exited"):
        llm.engine.check_health()
    with pytest.raises(TensorParallelError):
        generate(llm)
    with pytest.raises(TensorParallelError, match="step failed"):  # and stays failed
        generate(llm)
    llm.shutdown()
    assert rank_children() == []


SCRIPT = """
import sys, time
from engine import LLM, SamplingParams, StructuredOutputsParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32",
              kv_cache_memory_bytes=8 << 20, num_threads=1)
    import multiprocessing
    print(multiprocessing.active_children()[0].pid, flush=True)
    while True:
        llm.generate([[0, 5, 6]], SamplingParams(max_tokens=4), use_tqdm=False)
        time.sleep(0.01)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_no_orphan_rank_when_the_parent_is_interrupted_or_killed(tmp_path, ckpts, sig):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, str(script), str(ckpts["llama"])], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        child = int(proc.stdout.readline())
        time.sleep(0.3)  # generating
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"rank process {child} outlived its parent"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
