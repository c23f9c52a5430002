"""The sampler on hand-made logits: penalties, min_tokens masking, logprobs, exact choices."""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.sample.sampler import Sampler


def make(prompt, output, eos=frozenset({9}), **params):
    r = Request("r", prompt, SamplingParams(temperature=0.0, **params), eos_token_ids=eos)
    for t in output:
        r.append_token(t, None)
    return r


def logits_row(values):
    out = torch.full((1, 10), -5.0)
    for token, value in values.items():
        out[0, token] = value
    return out


def sample(logits, req):
    return Sampler(0, torch.device("cpu"))(logits.clone(), [req])


def test_presence_and_frequency_penalties_act_on_output_tokens():
    logits = logits_row({5: 2.0, 6: 1.5})
    assert sample(logits, make([1], [5])).token_ids == [5]
    assert sample(logits, make([1], [5], presence_penalty=0.6)).token_ids == [6]
    assert sample(logits, make([1], [5], frequency_penalty=0.3)).token_ids == [5]
    assert sample(logits, make([1], [5, 5], frequency_penalty=0.3)).token_ids == [6]
    assert sample(logits, make([5], [], presence_penalty=2.0)).token_ids == [5]  # prompt: no


def test_repetition_penalty_covers_prompt_and_output():
    logits = logits_row({5: 2.0, 6: 1.5})
    assert sample(logits, make([5], [], repetition_penalty=1.5)).token_ids == [6]  # 2/1.5 < 1.5
    neg = logits_row({5: -1.0, 6: -1.2})
    assert sample(neg, make([5], [], repetition_penalty=1.5)).token_ids == [6]  # -1.5 < -1.2


def test_penalties_kept_step_by_step_equal_penalties_from_scratch():
    """A request's seen tokens and output counts are updated a step at a time: the penalized
    logits equal those computed from its whole sequence anew, batch after batch."""
    from engine.sample.logits_processors import SeenTokens

    gen = torch.Generator().manual_seed(4)
    kinds = [dict(repetition_penalty=1.3), dict(presence_penalty=0.7, frequency_penalty=0.4),
             dict(repetition_penalty=0.8, frequency_penalty=-0.5), dict()]
    reqs = [Request(f"r{i}", torch.randint(0, 50, (12,), generator=gen).tolist(),
                    SamplingParams(temperature=0.0, **kw)) for i, kw in enumerate(kinds)]
    kept = SeenTokens()
    for _ in range(6):
        logits = torch.randn(len(reqs), 50, generator=gen)
        step, fresh = logits.clone(), logits.clone()
        kept.apply(step, reqs)
        SeenTokens().apply(fresh, reqs)
        assert torch.equal(step, fresh)
        for r in reqs:  # two tokens some steps: more than one new token between calls
            for t in torch.randint(0, 50, (1 + len(r.all_token_ids) % 2,), generator=gen).tolist():
                r.append_token(t, None)
    assert not torch.equal(step, logits)
    for r in reqs:
        kept.forget(r.request_id)
    assert len(kept) == 0
    sampler = Sampler(0, torch.device("cpu"))  # the sampler forgets a request with its seed
    sampler(torch.randn(len(reqs), 50), reqs)
    assert len(sampler.seen_tokens) == 3  # the rows that have penalties
    for r in reqs:
        sampler.forget(r.request_id)
    assert len(sampler.seen_tokens) == 0


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = logits_row({9: 3.0, 4: 1.0, 3: 2.0})
    assert sample(logits, make([1], [], min_tokens=2)).token_ids == [3]
    assert sample(logits, make([1], [], min_tokens=2, stop_token_ids=[3])).token_ids == [4]
    assert sample(logits, make([1], [7, 7], min_tokens=2)).token_ids == [9]
    assert sample(logits, make([1], [], min_tokens=2, ignore_eos=True)).token_ids == [9]


def test_logprobs_are_raw_log_softmax():
    logits = logits_row({5: 2.0, 6: 1.5, 7: 1.0})
    out = sample(logits, make([1], [5], logprobs=2, presence_penalty=2.0))
    raw = torch.log_softmax(logits[0], -1)
    assert out.token_ids == [6]
    assert out.logprobs[0] == pytest.approx({6: raw[6].item(), 5: raw[5].item()})


def test_temperature_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(0, torch.device("cpu"))
    req = Request("r", [0], SamplingParams(temperature=1.0))
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler(logits, [req]).token_ids[0]] += 1
    assert counts[0] / 3000 == pytest.approx(0.7, abs=0.04)
    assert counts[2] / 3000 == pytest.approx(0.1, abs=0.03)
    topk = Request("k", [0], SamplingParams(temperature=1.0, top_k=2))
    assert {sampler(logits, [topk]).token_ids[0] for _ in range(300)} == {0, 1}
    topp = Request("p", [0], SamplingParams(temperature=1.0, top_p=0.8))
    assert {sampler(logits, [topp]).token_ids[0] for _ in range(300)} == {0, 1}
    minp = Request("m", [0], SamplingParams(temperature=1.0, min_p=0.2))
    assert {sampler(logits, [minp]).token_ids[0] for _ in range(300)} == {0, 1}
