"""Response streams without a Ray cluster: the Worker's parts -> text, cut at stop strings."""

from __future__ import annotations

import asyncio

from engine.sampling_params import SamplingParams
from serve_app.batcher import EngineRequest
from serve_app.streams import ResponseStream
from serve_app.wire import DonePart, TokenPart


def _req(n_tokens: int = 4) -> EngineRequest:
    return EngineRequest(list(range(n_tokens)), SamplingParams(max_tokens=2))


def test_stop_string_cuts_text_and_releases_the_request():
    from transformers import AutoTokenizer

    from engine.models.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    ids = tok("The quick brown fox jumps", add_special_tokens=False).input_ids

    async def run():
        r = _req()
        released = []
        stream = ResponseStream([r], tok, stop=[" brown"], include_stop_str_in_output=False,
                                skip_special_tokens=True, num_logprobs=None,
                                release=lambda req, reason: released.append((req, reason)))
        for t in ids:
            r.put(TokenPart(0, 0, [t], None, None))
        r.put(DonePart(0, 4, 0))
        text, finish = "", None
        async for deltas in stream.deltas():
            for d in deltas:
                text += d.text
                finish = d.finish_reason or finish
        return text, finish, released

    text, finish, released = asyncio.run(run())
    assert text == "The quick"
    assert finish == "stop"
    assert len(released) == 1 and released[0][1] == "stop"  # counted as a stop, not an abort


def test_stop_reason_names_the_stop_string_or_stop_token_id():
    """As vLLM's: the stop string or the ``stop_token_ids`` id that ended a choice; None for
    EOS and the length limit. The formats carry it with the system fingerprint."""
    from transformers import AutoTokenizer

    from engine.models.default_model import default_model_path
    from serve_app.responses import ChatFormat, CompletionFormat

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    ids = tok("The quick brown fox jumps", add_special_tokens=False).input_ids
    eos = tok.eos_token_id

    async def final(stop: list[str], params: SamplingParams, finish: str, fmt_cls):
        r = EngineRequest([1, 2], params)
        stream = ResponseStream([r], tok, stop=stop, include_stop_str_in_output=False,
                                skip_special_tokens=True, num_logprobs=None,
                                release=lambda req, reason: None)
        r.put(TokenPart(0, 0, ids[:-1], None, None))
        r.put(TokenPart(0, 0, ids[-1:], finish, None))
        r.put(DonePart(0, 2, 0))
        fmt = fmt_cls("id-1", "m", tok, 1, "fp_1")
        async for deltas in stream.deltas():
            fmt.collect(deltas)
        body = fmt.final(stream.usage)
        assert body["system_fingerprint"] == "fp_1"
        return body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]

    def run(stop, params, finish, fmt_cls=CompletionFormat):
        return asyncio.run(final(stop, params, finish, fmt_cls))

    assert run([" brown"], SamplingParams(), "length") == ("stop", " brown")
    assert run([], SamplingParams(stop_token_ids=[ids[-1]]), "stop") == ("stop", ids[-1])
    assert run([], SamplingParams(stop_token_ids=[ids[-1]]), "stop", ChatFormat) == \
        ("stop", ids[-1])
    ids.append(eos)  # the last token now EOS, not one of stop_token_ids
    assert run([], SamplingParams(stop_token_ids=[ids[0]]), "stop", ChatFormat) == ("stop", None)
    assert run([], SamplingParams(), "length") == ("length", None)
