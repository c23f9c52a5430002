"""The answer to a prepared request: its formatter, and its body as server-sent events.

``formatter`` picks the endpoint's format (``CompletionFormat`` or ``ChatFormat``) and sets it
up from the request's ``OutputSpec``; ``sse_body`` streams a ``ResponseStream`` through it
(vLLM's ``continuous_usage_stats`` and ``include_usage``, then ``[DONE]``; an error after the
first chunk is sent as a last event in OpenAI's shape, since the status line is gone).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from serve_app.protocol.errors import APIError
from serve_app.router.chat_format import ChatFormat
from serve_app.router.completion_format import CompletionFormat
from serve_app.router.prepared import PreparedRequest
from serve_app.router.responses import SSE_DONE, Decoder, Formatter, sse
from serve_app.router.streams import ResponseStream


def formatter(prep: PreparedRequest, response_id: str, model: str, tokenizer: Decoder,
              fingerprint: str) -> Formatter:
    """The formatter of ``prep``'s answer, for ``len(prep.prompts) x n`` choices."""
    out = prep.output
    ids = prep.prompts if out.return_token_ids else None
    fmt: Formatter
    if out.kind == "completion":
        fmt = CompletionFormat(response_id, model, tokenizer, prep.num_seqs, fingerprint,
                               n=out.n, want_logprobs=out.num_logprobs is not None,
                               echo_texts=out.echo_texts, echo_logprobs=out.echo_logprobs,
                               prompt_logprobs=out.prompt_logprobs, prompt_token_ids=ids)
    else:
        fmt = ChatFormat(response_id, model, tokenizer, prep.num_seqs, fingerprint,
                         want_logprobs=out.num_logprobs is not None, tools=out.tools,
                         prompt_logprobs=out.prompt_logprobs, prompt_token_ids=ids)
    fmt.tokens_as_ids = out.tokens_as_ids
    return fmt


async def sse_body(prep: PreparedRequest, stream: ResponseStream, fmt: Formatter,
                   finish: Callable[[], None]) -> AsyncIterator[str]:
    """The events of a streamed answer; ``finish`` runs when the body ends, however it
    ends."""
    out = prep.output

    def event(chunk: dict[str, object]) -> str:  # vLLM's continuous_usage_stats
        return sse({**chunk, "usage": stream.usage.as_dict()} if out.usage_in_every_chunk
                   else chunk)

    try:
        for chunk in fmt.opening_chunks(prep.num_seqs):
            yield event(chunk)
        async for deltas in stream.deltas():
            for chunk in fmt.stream_chunks(deltas):
                yield event(chunk)
        if out.include_usage:
            yield sse(fmt.usage_chunk(stream.usage))
        yield SSE_DONE
    except APIError as exc:
        yield sse(exc.body())
        yield SSE_DONE
    finally:
        finish()
