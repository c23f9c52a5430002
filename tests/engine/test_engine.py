"""Engine behaviour end to end on a small random Llama: the same greedy outputs however the
work is batched, cached, chunked or preempted; sampling options; stop conditions; bad input."""

from __future__ import annotations

import json

import pytest

from engine import LLM, LLMEngine, SamplingParams
from tests.checkpoints import make_checkpoint

SHARED = list(range(200, 240))  # a 40-token prefix several prompts share
PROMPTS = [
    [0, *SHARED, 5, 6, 7],
    [0, *SHARED, 9],
    [0, 11, 12, 13],
    [0, *range(300, 357)],
    [0, *SHARED, 5, 6, 7, 8, 44, 45],
    [0, 42],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def as_inputs(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)


@pytest.fixture(scope="module")
def reference(llm):
    return tokens(llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False))


def test_outputs_are_deterministic_and_depend_on_the_prompt(reference):
    assert all(len(t) == 24 for t in reference)
    assert len({tuple(t) for t in reference}) == len(reference)


@pytest.mark.parametrize("overrides", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),  # forces chunked prefill
    dict(max_num_seqs=2),
    dict(block_size=16, max_num_batched_tokens=33),
], ids=["no-prefix-cache", "chunked-prefill", "two-seqs", "block16-odd-budget"])
def test_same_greedy_outputs_under_other_batching(ckpt, reference, overrides):
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8) | overrides
    other = LLM(ckpt, **kwargs)
    assert tokens(other.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)) == reference


def test_prefix_cache_hits_are_used(llm, reference):
    kv = llm.engine.kv
    hits_before = kv.prefix_hits
    assert tokens(llm.generate(as_inputs(PROMPTS[:2]), GREEDY, use_tqdm=False)) == reference[:2]
    assert kv.prefix_hits - hits_before >= 2 * 40


def test_same_outputs_under_preemption(ckpt, reference):
    # 4 KiB per block of 8 tokens: 20 blocks hold 160 tokens, far less than the batch needs.
    small = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=20 * 4096, block_size=8,
                max_model_len=128)
    assert tokens(small.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)) == reference
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv.num_free_blocks == small.engine.kv.num_blocks


def test_each_prompt_alone_equals_the_batch(llm, reference):
    for prompt, expected in zip(PROMPTS, reference):
        assert tokens(llm.generate(as_inputs([prompt]), GREEDY, use_tqdm=False)) == [expected]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = tokens(llm.generate(as_inputs([PROMPTS[2]]), seeded, use_tqdm=False))[0]
    others = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    mixed = llm.generate(as_inputs(PROMPTS), [others, others, seeded, others, others, others],
                         use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    again = tokens(llm.generate(as_inputs([PROMPTS[2]]), seeded, use_tqdm=False))[0]
    assert again == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=4321, ignore_eos=True)
    assert tokens(llm.generate(as_inputs([PROMPTS[2]]), other_seed, use_tqdm=False))[0] != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm, reference):
    for params in (SamplingParams(max_tokens=24, temperature=1.5, top_k=1, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=1.0, min_p=1.0, ignore_eos=True)):
        assert tokens(llm.generate(as_inputs(PROMPTS[:3]), params, use_tqdm=False)) == \
            reference[:3]


def test_parallel_sampling_shares_prompt_blocks(ckpt):
    engine = LLMEngine(dtype="float32", model=ckpt, kv_cache_memory_bytes=4 << 20, block_size=8,
                       progress=False)
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request("r", PROMPTS[3], params)  # 58 tokens: 7 full blocks
    engine.step()
    engine.step()
    parent, *children = engine.groups["r"].seqs
    assert [c.block_ids[:7] for c in children] == [parent.block_ids[:7]] * 2
    assert all(engine.kv.blocks[b].ref_cnt == 3 for b in parent.block_ids[:7])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    final = outs[-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in final.outputs)
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_max_tokens_stop_token_ids_and_min_tokens(llm, reference):
    first = reference[2]
    out = llm.generate(as_inputs([PROMPTS[2]]), SamplingParams(max_tokens=5, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[:5] and out.finish_reason == "length"
    stop_id = first[4]
    cut = first.index(stop_id) + 1
    out = llm.generate(as_inputs([PROMPTS[2]]),
                       SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == first[:cut] and out.finish_reason == "stop"
    assert out.stop_reason == stop_id
    out = llm.generate(as_inputs([PROMPTS[2]]),
                       SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[first[0]],
                                      min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != first[0] and len(out.token_ids) >= 3


def test_eos_from_generation_config_stops_unless_ignored(tmp_path, reference):
    path = make_checkpoint(tmp_path / "eos")
    eos = reference[3][6]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    out = llm.generate(as_inputs([PROMPTS[3]]), SamplingParams(max_tokens=24, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[3][: reference[3].index(eos) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None  # as vLLM: EOS gives none
    out = llm.generate(as_inputs([PROMPTS[3]]), GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[3]


def test_stop_strings_cut_the_text_like_openai(llm):
    prompt = "Hello, my name is"
    full = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[6:9]
    assert stop and full.find(stop) == 6, full
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:6] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=["zzzz", stop],
                                              include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:9]


def test_logprobs_hold_the_chosen_token_and_top_n(llm, reference):
    out = llm.generate(as_inputs([PROMPTS[0]]),
                       SamplingParams(max_tokens=4, temperature=0, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and len(lp) == 5  # greedy: the chosen token is the top one
        assert lp[token] == max(lp.values()) and all(v <= 0 for v in lp.values())


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt must not be empty"),
    ([], SamplingParams(), "prompt must not be empty"),
    ([0, 5000], SamplingParams(), "prompt token ids must be integers in [0, 767]"),
    ({"prompt_token_ids": list(range(600))}, SamplingParams(),
     "prompt is 600 tokens long; max_model_len is 512"),
    ({"text": "x"}, SamplingParams(), "needs 'prompt' or 'prompt_token_ids'"),
])
def test_bad_prompts_raise_and_leave_the_engine_serving(llm, reference, prompt, params, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, prompt], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert tokens(llm.generate(as_inputs([PROMPTS[0]]), GREEDY, use_tqdm=False)) == reference[:1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature must be in \[0, 100\]"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(max_tokens=-1), r"max_tokens must be in \[0, 2147483647\]"),
    (dict(top_k=-2), r"top_k must be in \[-1, 2147483647\]"),
    (dict(prompt_logprobs=21), r"prompt_logprobs must be in \[0, 20\]"),
    (dict(bad_words=[" "]), "bad_words must be a list of at most 128 non-blank strings"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must be a non-empty list of token ids"),
    (dict(n=0), r"n must be in \[1, 1024\]"),
    (dict(logprobs=50), r"logprobs must be in \[0, 20\]"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be <= max_tokens"),
    # upper bounds: each of these once reached the batched step and failed every request in it
    (dict(top_k=2 ** 63 - 1), r"top_k must be in \[-1, 2147483647\]"),
    (dict(top_k=2 ** 64), "top_k must be in"),
    (dict(n=10 ** 6), r"n must be in \[1, 1024\]"),
    (dict(max_tokens=2 ** 63), "max_tokens must be in"),
    (dict(min_tokens=2 ** 40, max_tokens=None), "min_tokens must be in"),
    (dict(stop_token_ids=[2 ** 63]), "stop_token_ids must be integer token ids"),
    (dict(stop=["x"] * 65), "stop takes at most 64"),
    # types: a float, bool or string where an integer belongs
    (dict(logprobs=2.5), "logprobs must be an integer"),
    (dict(seed=1.0), "seed must be an integer"),
    (dict(n=True), "n must be an integer"),
    (dict(top_k="5"), "top_k must be an integer"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids must be integer token ids"),
    (dict(stop=5), "stop must be a list"),
    (dict(stop=[""]), "stop must be non-empty strings"),
    (dict(ignore_eos=1), "ignore_eos must be a bool"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(temperature=True), "temperature must be a finite number"),
])
def test_bad_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_config_errors_at_start_up(tmp_path, ckpt):
    bad = make_checkpoint(tmp_path / "gpt", arch="llama")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not supported; supported: .*"
                       "LlamaForCausalLM, MistralForCausalLM, .*Phi3ForCausalLM, "
                       "Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(bad))
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        LLM(str(bad))
    with pytest.raises(ValueError, match=r"KV cache too small: .* needs 262144 bytes"):
        LLM(ckpt, dtype="float32", kv_cache_memory_bytes=10_000, block_size=8)
    with pytest.raises(ValueError, match="max_model_len=4096 is over the model's "
                       "max_position_embeddings=512"):
        LLM(ckpt, max_model_len=4096)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        LLM(ckpt, block_size=12)
    with pytest.raises(ValueError, match="unknown engine argument 'blocksize'"):
        LLM(ckpt, blocksize=16)


def test_sharded_and_half_precision_checkpoints_load(tmp_path, reference):
    path = make_checkpoint(tmp_path / "sharded", shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    assert tokens(llm.generate(as_inputs(PROMPTS), GREEDY, use_tqdm=False)) == reference
    bf16 = LLM(str(path), dtype="bfloat16", kv_cache_memory_bytes=4 << 20, block_size=8)
    assert bf16.engine.runner.kv_cache.dtype.is_floating_point
    out = bf16.generate(as_inputs(PROMPTS[:2]), GREEDY, use_tqdm=False)
    assert all(len(t) == 24 for t in tokens(out))


def test_memory_profiling_forward_runs_over_a_full_token_budget(ckpt):
    # On CUDA this forward sizes the cache; here it checks its batch description is valid.
    llm = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=1 << 20, block_size=8,
              max_num_batched_tokens=300)
    runner = llm.engine.runner
    runner._profile_run()  # with the heaviest sampling of its logits
    assert runner.kv_cache is None
    runner._profile_graph_pool()  # the largest CUDA-graph batch's forward (decode-sized)
    assert runner.kv_cache is None
    runner.kv.bind(runner.num_blocks)
    out = llm.generate(as_inputs(PROMPTS[:1]), GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 24


def test_engine_config_from_yaml_flat_and_nested(tmp_path):
    from engine import EngineConfig

    flat = tmp_path / "flat.yaml"
    flat.write_text("model: /models/x\n")
    assert EngineConfig.from_yaml(flat).model.model == "/models/x"
    nested = tmp_path / "nested.yaml"
    nested.write_text("model: {model: /models/y, dtype: bfloat16}\ncache: {block_size: 32}\n")
    cfg = EngineConfig.from_yaml(nested)
    assert (cfg.model.model, cfg.model.dtype, cfg.cache.block_size) == ("/models/y", "bfloat16", 32)
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_size: 12\n")
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig.from_yaml(bad)


def test_layers_share_one_rotary_table(llm):
    """One cos/sin table per model, not one per layer (64 MiB per layer at 128k positions)."""
    from engine.layers.rotary import RotaryEmbedding

    tables = {id(m.cos_sin_cache) for m in llm.engine.runner.model.modules()
              if isinstance(m, RotaryEmbedding)}
    layers = len(llm.engine.runner.model.model.layers)
    assert layers > 1 and len(tables) == 1
