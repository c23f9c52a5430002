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
