"""One streamed OpenAI completion, counted on the client and judged: success or why not.

The benchmarks (``serving_benchmark.py``, ``big_prompt_itl.py``) feed every SSE line of a
``200`` stream to a ``StreamCount`` and ask ``failure`` for the verdict. A stream fails when

* an event carries an error object: ``{"error": {...}}`` (what this app's Router and vLLM's
  server send when a request fails mid-stream, before their ``[DONE]``) or vLLM's older
  ``{"object": "error", ...}``: ``"sse error"``;
* an event is not JSON: ``"bad chunk"``;
* it ends without ``data: [DONE]`` (``"no [DONE]"``) or without a ``finish_reason``
  (``"no finish_reason"``);
* the server's ``usage.completion_tokens`` disagrees with the client's own count
  (``"usage mismatch"``): it must equal the token ids the chunks carried (vLLM's
  ``return_token_ids``, which this app also honours) and cannot be below the text chunks;
* with ``ignore_eos`` it did not produce exactly ``max_tokens`` tokens: fewer, or a
  ``finish_reason`` other than ``"length"`` (``"short output"``), or more (``"long output"``);
* no chunk carried text (``"no output"``: no time to first token to measure).

The token count is the client's own: the chunks' token ids when the server sends them (exact:
a chunk may carry several tokens, or none with text held back), else ``usage`` once it passed
the checks above, else the text chunks. ``usage`` alone is never believed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class StreamCount:
    """What one stream said, counted as it arrives."""

    text_chunks: int = 0  # events whose choices carry text: the timing points
    token_ids: int | None = None  # token ids the chunks carried; None: the server sent none
    usage_tokens: int | None = None  # the server's usage.completion_tokens, if it sent usage
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    error: str = ""  # the first error event (or bad chunk), shortened
    bad_chunk: bool = False

    def feed(self, line: str) -> bool:
        """Count one SSE line; True when it is an event with text (a token's arrival)."""
        line = line.strip()
        if not line.startswith("data:") or self.done:
            return False
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return False
        try:
            data = json.loads(payload)
        except ValueError:
            self.bad_chunk = True
            self.error = self.error or payload[:200]
            return False
        return self._event(data) if isinstance(data, dict) else False

    def _event(self, data: dict) -> bool:
        if data.get("error") is not None or data.get("object") == "error":
            self.error = self.error or json.dumps(data.get("error", data))[:200]
            return False
        if data.get("usage"):
            self.usage_tokens = data["usage"].get("completion_tokens")
        has_text = False
        for choice in data.get("choices") or ():
            ids = choice.get("token_ids")
            if ids is not None:
                self.token_ids = (self.token_ids or 0) + len(ids)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            has_text = has_text or bool(_text(choice))
        self.text_chunks += has_text
        return has_text

    def tokens(self) -> int:
        """Output tokens as counted here: token ids, else usage (once checked), else chunks."""
        for n in (self.token_ids, self.usage_tokens):
            if n is not None:
                return n
        return self.text_chunks

    def describe(self) -> str:
        return (f"{self.text_chunks} text chunks, token ids {self.token_ids}, usage "
                f"{self.usage_tokens}, finish_reason {self.finish_reason}, [DONE] {self.done}")


def failure(count: StreamCount, max_tokens: int, ignore_eos: bool) -> str:
    """Why the stream counts as failed ("" when it succeeded); the reasons are listed above."""
    if count.error:
        return "bad chunk" if count.bad_chunk else "sse error"
    if not count.done:
        return "no [DONE]"
    if count.finish_reason is None:
        return "no finish_reason"
    usage, ids = count.usage_tokens, count.token_ids
    if ignore_eos and (count.finish_reason != "length" or (ids is not None and ids < max_tokens)):
        return "short output"
    if usage is not None and (usage != ids if ids is not None else usage < count.text_chunks):
        return "usage mismatch"
    if max(count.tokens(), count.text_chunks) > max_tokens:
        return "long output"
    if ignore_eos and count.tokens() < max_tokens:
        return "short output"
    if count.text_chunks == 0:
        return "no output"
    return ""


def _text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""
