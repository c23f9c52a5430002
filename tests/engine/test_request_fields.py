"""vLLM's request fields beyond sampling, end to end on a small random Llama: prompt logprobs
(against Hugging Face), ``max_tokens=0``, ``truncate_prompt_tokens``, ``allowed_token_ids``,
``bad_words``, ``logit_bias``, ``cache_salt`` and ``top_k=0``."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample import sampler
from engine.sample.logits_processors import bad_words_ids, banned_tokens
from tests.checkpoints import make_checkpoint

PROMPT = [0, *range(200, 229)]  # 30 tokens: several blocks of 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_logprobs(ckpt):
    """Hugging Face's log-softmax at every position of PROMPT, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def generate(llm, prompt, **kwargs):
    return llm.generate({"prompt_token_ids": prompt}, SamplingParams(**kwargs),
                        use_tqdm=False)[0]


def check_prompt_logprobs(lps, hf, num):
    assert lps[0] is None and len(lps) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        row, token = hf[pos - 1], PROMPT[pos]
        entry = lps[pos]
        rank = int((row > row[token]).sum()) + 1
        assert entry[token].rank == rank
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = row.topk(num)
        expected = {int(i): (float(v), j + 1) for j, (v, i) in enumerate(zip(*top, strict=True))}
        assert set(entry) == set(expected) | {token}
        for tok, (value, r) in expected.items():
            assert entry[tok].logprob == pytest.approx(value, abs=1e-4)
            assert entry[tok].rank == (rank if tok == token else r)


@pytest.mark.parametrize("budget, rows_at_once", [(None, 512), (7, 512), (None, 4)],
                         ids=["one-step", "chunked-prefill", "scored-4-rows-at-once"])
def test_prompt_logprobs_match_hugging_face(ckpt, hf_logprobs, budget, rows_at_once,
                                            monkeypatch):
    monkeypatch.setattr(sampler, "PROMPT_ROWS_AT_ONCE", rows_at_once)
    kwargs = {} if budget is None else {"max_num_batched_tokens": budget}
    llm = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
              enable_prefix_caching=True, **kwargs)
    generate(llm, PROMPT, max_tokens=2, **GREEDY)  # caches the prompt's blocks
    hits = llm.engine.kv.prefix_hits
    out = generate(llm, PROMPT, max_tokens=2, prompt_logprobs=3, **GREEDY)
    assert llm.engine.kv.prefix_hits == hits  # the cache is skipped: every position is scored
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out.prompt_logprobs, hf_logprobs, 3)
    assert out.outputs[0].token_ids == [int(hf_logprobs[-1].argmax()), out.outputs[0].token_ids[1]]


def test_prompt_logprobs_of_n_sequences_and_delta_outputs(llm, hf_logprobs):
    out = generate(llm, PROMPT, n=3, max_tokens=2, prompt_logprobs=2, temperature=1.0, seed=1)
    assert len(out.outputs) == 3
    check_prompt_logprobs(out.prompt_logprobs, hf_logprobs, 2)
    engine = llm.engine
    engine.add_request("delta", {"prompt_token_ids": PROMPT}, SamplingParams(
        max_tokens=3, prompt_logprobs=1, output_kind="delta", **GREEDY))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    check_prompt_logprobs(outs[0].prompt_logprobs, hf_logprobs, 1)


def test_max_tokens_zero_returns_the_prompt_only(llm, hf_logprobs):
    out = generate(llm, PROMPT, max_tokens=0, prompt_logprobs=0, logprobs=1, **GREEDY)
    c = out.outputs[0]
    assert (c.token_ids, c.text, c.finish_reason, c.logprobs) == ([], "", "length", [])
    check_prompt_logprobs(out.prompt_logprobs, hf_logprobs, 0)
    assert generate(llm, PROMPT, max_tokens=2).prompt_logprobs is None


def test_truncate_prompt_tokens_keeps_the_last_ids(llm):
    long = [0, *range(300, 360)]
    out = generate(llm, long, max_tokens=4, truncate_prompt_tokens=10, **GREEDY)
    assert out.prompt_token_ids == long[-10:]
    assert out.outputs[0].token_ids == generate(llm, long[-10:], max_tokens=4,
                                                **GREEDY).outputs[0].token_ids
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens must be in \[1, "):
        SamplingParams(truncate_prompt_tokens=0)


def test_allowed_token_ids_restrict_greedy_to_the_masked_argmax(llm, hf_logprobs):
    allowed = [5, 17, 400, 401, 700]
    out = generate(llm, PROMPT, max_tokens=1, allowed_token_ids=allowed, logprobs=0, **GREEDY)
    masked = hf_logprobs[-1][allowed]
    assert out.outputs[0].token_ids == [allowed[int(masked.argmax())]]
    out = generate(llm, PROMPT, max_tokens=12, allowed_token_ids=allowed, **GREEDY)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    sampled = generate(llm, PROMPT, max_tokens=12, allowed_token_ids=[9, 10], temperature=1.0,
                       seed=3, ignore_eos=True)
    assert set(sampled.outputs[0].token_ids) <= {9, 10}
    with pytest.raises(ValueError, match=r"allowed_token_ids must be in \[0, 767\], got \[768\]"):
        generate(llm, PROMPT, allowed_token_ids=[5, 768])
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])


def test_logit_bias_shifts_the_logits_before_sampling(llm, hf_logprobs):
    last = hf_logprobs[-1]
    top2 = [int(t) for t in last.topk(2).indices]
    # -100 on the greedy token: the runner-up wins; the reported logprob is the raw model's
    out = generate(llm, PROMPT, max_tokens=1, logit_bias={top2[0]: -100.0}, logprobs=0, **GREEDY)
    c = out.outputs[0]
    assert c.token_ids == [top2[1]]
    assert c.logprobs[0][top2[1]] == pytest.approx(float(last[top2[1]]), abs=1e-4)
    # a bias just over the gap to the top lifts the token; just under, it does not
    gap = float(last[top2[0]] - last[400])
    lifted = generate(llm, PROMPT, max_tokens=1, logit_bias={400: gap + 0.05}, **GREEDY)
    assert lifted.outputs[0].token_ids == [400]
    kept = generate(llm, PROMPT, max_tokens=1, logit_bias={400: gap - 0.05}, **GREEDY)
    assert kept.outputs[0].token_ids == [top2[0]]
    # +100 on one token decides every step, greedy or sampled; other rows are unaffected
    forced = generate(llm, PROMPT, max_tokens=6, logit_bias={7: 100, 9: -5.5}, **GREEDY)
    assert forced.outputs[0].token_ids == [7] * 6
    sampled = generate(llm, PROMPT, max_tokens=6, logit_bias={11: 100.0}, temperature=1.0,
                       seed=5, ignore_eos=True)
    assert sampled.outputs[0].token_ids == [11] * 6
    plain = generate(llm, PROMPT, max_tokens=6, **GREEDY).outputs[0].token_ids
    engine = llm.engine
    engine.add_request("biased", {"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=6, logit_bias={7: 100.0}, **GREEDY))
    engine.add_request("plain", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=6, **GREEDY))
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert done == {"biased": [7] * 6, "plain": plain}
    # the rows' tensors are built once and dropped with their request: an id used again
    # gets its own bias, and an aborted request leaves nothing behind
    rows = engine.runner.sampler.row_tensors
    assert len(rows) == 0
    for token in (9, 12):
        engine.add_request("again", {"prompt_token_ids": PROMPT}, SamplingParams(
            max_tokens=2, logit_bias={token: 100.0}, allowed_token_ids=[9, 12], **GREEDY))
        outs = [o for _ in range(3) for o in engine.step() if o.finished]
        assert outs[0].outputs[0].token_ids == [token] * 2
    engine.add_request("dropped", {"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=8, logit_bias={7: 1.0}, **GREEDY))
    engine.step()
    assert len(rows) == 1
    engine.abort("dropped")
    assert len(rows) == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("bias, message", [
    ({768: 1.0}, r"logit_bias must be in \[0, 767\], got \[768\]"),
    ({5: 100.5}, r"logit_bias must map token ids in \[0, 2147483647\] to numbers in \[-100, 100\]"),
    ({5: float("nan")}, "logit_bias must map"),
    ({5: True}, "logit_bias must map"),
    ({-1: 1.0}, "logit_bias must map"),
    ({"5": 1.0}, "logit_bias must map"),
    ([5], "logit_bias must map"),
])
def test_logit_bias_is_checked(llm, bias, message):
    with pytest.raises(ValueError, match=message):
        generate(llm, PROMPT, max_tokens=1, logit_bias=bias)


def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    assert bad_words_ids(tok, ["ar", " token", "fll", "a"]) == [
        [305], [460, 295], [74, 338], [299, 338], [69], [262]]  # the spaced form where it differs
    base = generate(llm, PROMPT, max_tokens=16, **GREEDY).outputs[0].token_ids
    assert base[5:10] == [86, 305, 244, 74, 338]
    out = generate(llm, PROMPT, max_tokens=16, bad_words=["ar"], **GREEDY).outputs[0].token_ids
    assert out[:6] == base[:6] and 305 not in out  # one token: banned everywhere
    out = generate(llm, PROMPT, max_tokens=16, bad_words=["fll"], **GREEDY).outputs[0].token_ids
    assert out[:9] == base[:9] and out[9] != 338  # 338 banned right after 74 only
    assert all(out[i:i + 2] != [74, 338] for i in range(len(out)))


def test_bad_words_ban_a_word_s_last_token_after_the_rest():
    words = [[7], [3, 4, 5]]
    assert banned_tokens(words, []) == [7]
    assert banned_tokens(words, [1, 3, 4]) == [7, 5]
    assert banned_tokens(words, [3, 4, 1]) == [7]
    assert banned_tokens(words, [4]) == [7]


def test_cache_salt_isolates_prefix_caches(ckpt):
    llm = LLM(ckpt, dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
              enable_prefix_caching=True)
    kv = llm.engine.kv
    runs = []
    for salt in ["a", "a", "b", None, None, "b"]:
        before = kv.prefix_hits
        out = generate(llm, PROMPT, max_tokens=2, cache_salt=salt, **GREEDY)
        runs.append((kv.prefix_hits - before, out.num_cached_tokens, out.outputs[0].token_ids))
    # 30 prompt tokens: 3 full blocks of 8 (24 tokens) can be reused
    assert [r[:2] for r in runs] == [(0, 0), (24, 24), (0, 0), (0, 0), (24, 24), (24, 24)]
    assert len({tuple(r[2]) for r in runs}) == 1
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="")


def test_top_k_zero_and_minus_one_are_off(llm):
    outs = [generate(llm, PROMPT, max_tokens=8, top_k=k, temperature=1.0, seed=7,
                     ignore_eos=True).outputs[0].token_ids for k in (0, -1)]
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match=r"top_k must be in \[-1, "):
        SamplingParams(top_k=-2)
