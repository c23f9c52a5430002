"""Response streams without a Ray cluster: the Worker's parts -> text, cut at stop strings."""

from __future__ import annotations

import asyncio

from engine.core.sampling_params import SamplingParams
from serve_app.router.batch import EngineRequest
from serve_app.router.streams import ResponseStream
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
    from serve_app.router.chat_format import ChatFormat
    from serve_app.router.completion_format import CompletionFormat

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


def test_return_token_ids_in_chunks_and_final_responses():
    """vLLM's ``return_token_ids``: each choice's ids (a stream's chunks: their new ones, held
    text's ids included), the prompt's once per completion choice or per chat response."""
    from serve_app.protocol.tools import ToolPlan
    from serve_app.router.chat_format import ChatFormat
    from serve_app.router.completion_format import CompletionFormat
    from serve_app.router.streams import Delta

    prompts = [[5, 6], [7, 8, 9]]

    def deltas():  # 2 prompts x n=2; choice 1 holds its text back (a stop-string prefix)
        return [[Delta(0, "a", [10]), Delta(1, "", [11]), Delta(3, "c", [13, 14])],
                [Delta(1, "bb", [12], "length"), Delta(2, "d", [15], "stop"),
                 Delta(0, "e", [16], "length"), Delta(3, "", [], "stop")]]

    fmt = CompletionFormat("id", "m", None, 4, n=2, prompt_token_ids=prompts)
    chunks = [c for ds in deltas() for c in fmt.stream_chunks(ds)]
    got = [(c["index"], c.get("prompt_token_ids"), c["token_ids"]) for ch in chunks
           for c in ch["choices"]]
    assert got == [(0, [5, 6], [10]), (1, [5, 6], [11]), (3, [7, 8, 9], [13, 14]),
                   (1, None, [12]), (2, [7, 8, 9], [15]), (0, None, [16]), (3, None, [])]
    fmt = CompletionFormat("id", "m", None, 4, n=2, prompt_token_ids=prompts)
    for ds in deltas():
        fmt.collect(ds)
    body = fmt.final(None)  # type: ignore[arg-type]
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in body["choices"]] == [
        ([5, 6], [10, 16]), ([5, 6], [11, 12]), ([7, 8, 9], [15]), ([7, 8, 9], [13, 14])]
    plain = CompletionFormat("id", "m", None, 4, n=2)
    assert all("token_ids" not in c for ds in deltas() for ch in plain.stream_chunks(ds)
               for c in ch["choices"])

    chat = ChatFormat("id", "m", None, 2, prompt_token_ids=[[1, 2, 3]])
    assert chat.role_chunk(2)["prompt_token_ids"] == [1, 2, 3]
    [content, finish] = chat.stream_chunks([Delta(0, "", [40]), Delta(1, "x", [41], "stop")])
    assert [(c["index"], c["token_ids"]) for c in content["choices"]] == [(0, [40]), (1, [41])]
    assert "prompt_token_ids" not in content and "token_ids" not in finish["choices"][0]
    chat.collect([Delta(0, "y", [42], "length")])
    body = chat.final(None)  # type: ignore[arg-type]
    assert body["prompt_token_ids"] == [1, 2, 3]
    assert [c["token_ids"] for c in body["choices"]] == [[42], []]
    assert "prompt_token_ids" not in ChatFormat("id", "m", None, 1).role_chunk(1)

    tools = ChatFormat("id", "m", None, 1, tools=ToolPlan("auto", [], parser="hermes"),
                       prompt_token_ids=[[1]])
    assert tools.stream_chunks([Delta(0, "Sure", [50, 51])]) == []
    *_, last = tools.stream_chunks([Delta(0, ".", [52], "stop")])
    assert last["choices"][0]["token_ids"] == [50, 51, 52]
