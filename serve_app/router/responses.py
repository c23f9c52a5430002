"""OpenAI response bodies: what completion and chat formatters share, and SSE framing.

A formatter turns ``Delta`` lists from ``ResponseStream`` into chunk dicts (streaming) or
collects them into the final response: ``CompletionFormat``
(``serve_app/router/completion_format.py``) and ``ChatFormat``
(``serve_app/router/chat_format.py``), both made from a prepared request by
``serve_app/router/answer.py``. Plain dicts: no per-token pydantic objects. With vLLM's
``return_token_ids`` (a formatter given ``prompt_token_ids``) choices carry their ``token_ids``
(in a stream: each chunk's new ones) and the prompt's ids come once: on each completion choice,
at the top of a chat response (in a stream: on the first chunk), where vLLM puts them.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Protocol

from serve_app.protocol.prompt_logprobs import Prompt
from serve_app.router.streams import Delta, LogprobEntry, Usage


class Decoder(Protocol):
    """What a formatter uses of the tokenizer: one token's text."""

    def decode(self, token_ids: list[int]) -> str: ...


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


class Formatter:
    """The response's envelope, its choices' collected text, finish reasons, logprobs and
    token ids; subclasses shape the chunks and the final body."""

    object_chunk = ""
    object_final = ""

    def __init__(self, response_id: str, model: str, tokenizer: Decoder | None,
                 num_choices: int, system_fingerprint: str | None = None) -> None:
        self.id = response_id
        self.model = model
        self.system_fingerprint = system_fingerprint
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._token_text: dict[int, str] = {}
        self._texts = [""] * num_choices
        self._finish: list[str | None] = [None] * num_choices
        self._stop_reason: list[int | str | None] = [None] * num_choices
        self._logprobs: list[list[LogprobEntry]] = [[] for _ in range(num_choices)]
        self._prompt_ids: list[list[int]] | None = None  # per prompt; None: ids not asked for
        self._ids: list[list[int]] = [[] for _ in range(num_choices)]  # (when asked for)
        self.tokens_as_ids = False  # vLLM's return_tokens_as_token_ids: "token_id:<id>"

    def _envelope(self, obj: str, choices: list[dict[str, Any]],
                  usage: Usage | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices}
        if usage is not None:
            body["usage"] = usage.as_dict()
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], usage)

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chunks a stream opens with, before any token (none, unless the format has some)."""
        return []

    def stream_chunks(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """The chunks to stream for ``deltas`` (none when they carry nothing to send)."""
        raise NotImplementedError

    def final(self, usage: Usage, prompts: list[Prompt] | None = None) -> dict[str, Any]:
        """The whole response, from what ``collect`` gathered; ``prompts`` (per prompt: its
        ids and logprobs) for prompt logprobs."""
        raise NotImplementedError

    def collect(self, deltas: list[Delta]) -> None:
        for d in deltas:
            self._texts[d.index] += d.text
            if d.finish_reason is not None:
                self._finish[d.index] = d.finish_reason
                self._stop_reason[d.index] = d.stop_reason
            if d.logprobs:
                self._logprobs[d.index].extend(d.logprobs)
            if self._prompt_ids is not None:
                self._ids[d.index].extend(d.token_ids)

    def _token_ids(self, ids: list[int]) -> dict[str, Any]:
        """A choice's ``token_ids`` field, when asked for."""
        return {} if self._prompt_ids is None else {"token_ids": ids}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            assert self._tokenizer is not None, "a formatter that names tokens needs a tokenizer"
            text = self._tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def logprob_token(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or ``token_id:<id>`` when asked for."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.token_text(token_id)


def finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return x if math.isfinite(x) else -9999.0
