"""OpenAI response bodies: completion and chat, streamed chunks and final JSON.

A formatter turns ``Delta`` lists from ``ResponseStream`` into chunk dicts (streaming) or
collects them into the final response. Plain dicts: no per-token pydantic objects. With vLLM's
``return_token_ids`` (a formatter given ``prompt_token_ids``) choices carry their ``token_ids``
(in a stream: each chunk's new ones) and the prompt's ids come once: on each completion choice,
at the top of a chat response (in a stream: on the first chunk), where vLLM puts them.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from serve_app.protocol.prompt_logprobs import Prompt, echo_logprobs, prompt_logprobs_json
from serve_app.protocol.tools import ToolPlan
from serve_app.router.streams import Delta, LogprobEntry, Usage


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")


class _Format:
    object_chunk = ""
    object_final = ""

    def __init__(self, response_id: str, model: str, tokenizer: Any, num_choices: int,
                 system_fingerprint: str | None = None) -> None:
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

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices}
        if usage is not None:
            body["usage"] = usage.as_dict()
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return self._envelope(self.object_chunk, [], usage)

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
            text = self._tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text

    def logprob_token(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or ``token_id:<id>`` when asked for."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.token_text(token_id)


class CompletionFormat(_Format):
    object_chunk = object_final = "text_completion"

    def __init__(self, *args: Any, echo_texts: list[str] | None = None,
                 want_logprobs: bool = False, n: int = 1, echo_logprobs: int | None = None,
                 prompt_logprobs: bool = False,
                 prompt_token_ids: list[list[int]] | None = None) -> None:
        super().__init__(*args)
        self._prompt_ids = prompt_token_ids
        self._want_logprobs = want_logprobs
        self._echo_logprobs = echo_logprobs  # top-N of the echoed prompt (echo and logprobs)
        self._prompt_logprobs = prompt_logprobs  # the prompt_logprobs field in each choice
        self._echo = echo_texts  # per prompt, prepended once to each of its choices
        self._echoed: set[int] = set()
        self._n = n
        self._offsets = [0] * len(self._texts)  # text_offset of the next streamed token
        self._ids_started: set[int] = set()  # choices whose prompt ids were streamed

    def _echo_for(self, index: int) -> str:
        if self._echo is None or index in self._echoed:
            return ""
        self._echoed.add(index)
        return self._echo[index // self._n]

    def chunk(self, deltas: list[Delta]) -> dict[str, Any]:
        choices = []
        for d in deltas:
            text = self._echo_for(d.index) + d.text
            logprobs = self._logprobs_obj(d.logprobs, self._offsets[d.index])
            self._offsets[d.index] += len(text)
            choices.append({"index": d.index, "text": text, "logprobs": logprobs,
                            "finish_reason": d.finish_reason, "stop_reason": d.stop_reason,
                            **self._ids_of(d.index, d.token_ids, streamed=True)})
        return self._envelope(self.object_chunk, choices)

    def _ids_of(self, index: int, ids: list[int], streamed: bool = False) -> dict[str, Any]:
        """``prompt_token_ids`` (once per streamed choice) and ``token_ids``, if asked for."""
        if self._prompt_ids is None:
            return {}
        first = not streamed or index not in self._ids_started
        self._ids_started.add(index)
        return {**({"prompt_token_ids": self._prompt_ids[index // self._n]} if first else {}),
                **self._token_ids(ids)}

    def collect(self, deltas: list[Delta]) -> None:
        for d in deltas:
            d.text = self._echo_for(d.index) + d.text
        super().collect(deltas)

    def stream_chunks(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        kept = [d for d in deltas if d.text or d.finish_reason or d.logprobs
                or (self._echo is not None and d.index not in self._echoed)
                or (self._prompt_ids is not None and d.token_ids)]
        return [self.chunk(kept)] if kept else []

    def final(self, usage: Usage, prompts: list[Prompt] | None = None) -> dict[str, Any]:
        """The response; ``prompts`` (per prompt: its ids and logprobs) for prompt logprobs."""
        choices: list[dict[str, Any]] = [{"index": i, "text": self._texts[i],
                    "logprobs": self._logprobs_obj(self._logprobs[i], 0),
                    "finish_reason": self._finish[i], "stop_reason": self._stop_reason[i]}
                   for i in range(len(self._texts))]
        for i, choice in enumerate(choices):
            prompt = prompts[i // self._n] if prompts else ([], None)
            if self._echo_logprobs is not None and prompt[1] is not None:
                choice["logprobs"] = echo_logprobs(prompt, self._echo_logprobs,
                                                   choice["logprobs"], self.logprob_token)
            if self._prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs_json(prompt[1] or [], self.token_text)
            choice.update(self._ids_of(i, self._ids[i]))
        return self._envelope(self.object_final, choices, usage)

    def _logprobs_obj(self, entries: list[LogprobEntry] | None, offset: int) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, lp, top in entries or ():
            text = self.logprob_token(tok)
            tokens.append(text)
            token_lps.append(_finite(lp))
            tops.append({self.logprob_token(t): _finite(v) for t, v in top.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}


class ChatFormat(_Format):
    object_chunk = "chat.completion.chunk"
    object_final = "chat.completion"

    def __init__(self, *args: Any, want_logprobs: bool = False,
                 tools: ToolPlan | None = None, prompt_logprobs: bool = False,
                 prompt_token_ids: list[list[int]] | None = None) -> None:
        super().__init__(*args)
        self._prompt_ids = prompt_token_ids
        self._want_logprobs = want_logprobs
        self._prompt_logprobs = prompt_logprobs  # the response's prompt_logprobs field
        self._tools = tools  # text is held back and parsed for calls when a choice ends

    def role_chunk(self, num_choices: int) -> dict[str, Any]:
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None, "stop_reason": None} for i in range(num_choices)]
        return self._with_prompt_ids(self._envelope(self.object_chunk, choices))

    def _with_prompt_ids(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._prompt_ids is not None:
            body["prompt_token_ids"] = self._prompt_ids[0]
        return body

    def chunk(self, deltas: list[Delta]) -> dict[str, Any]:
        """Content deltas; finish reasons go in a separate last chunk (``finish_chunk``)."""
        choices = [{"index": d.index, "delta": {"content": d.text},
                    "logprobs": self._logprobs_obj(d.logprobs), "finish_reason": None,
                    "stop_reason": None, **self._token_ids(d.token_ids)} for d in deltas
                   if d.text or d.logprobs or (self._prompt_ids is not None and d.token_ids)]
        return self._envelope(self.object_chunk, choices)

    def finish_chunk(self, deltas: list[Delta]) -> dict[str, Any]:
        choices: list[dict[str, Any]] = [
            {"index": d.index, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason,
             "stop_reason": d.stop_reason} for d in deltas if d.finish_reason]
        return self._envelope(self.object_chunk, choices)

    def stream_chunks(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        if self._tools is not None:
            return self._tool_chunks(deltas)
        out = [self.chunk(deltas), self.finish_chunk(deltas)]
        return [c for c in out if c["choices"]]

    def final(self, usage: Usage, prompts: list[Prompt] | None = None) -> dict[str, Any]:
        choices = []
        for i in range(len(self._texts)):
            message, finish = self._message(i)
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs_obj(self._logprobs[i]),
                            "finish_reason": finish, "stop_reason": self._stop_reason[i],
                            **self._token_ids(self._ids[i])})
        body = self._with_prompt_ids(self._envelope(self.object_final, choices, usage))
        if self._prompt_logprobs:
            lps = prompts[0][1] if prompts else None
            body["prompt_logprobs"] = prompt_logprobs_json(lps or [], self.token_text)
        return body

    def _message(self, i: int) -> tuple[dict[str, Any], str | None]:
        """Choice ``i``'s message and finish reason, with its tool calls parsed out."""
        text, finish = self._texts[i], self._finish[i]
        if self._tools is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = self._tools.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": content, "tool_calls": calls},
                "tool_calls" if finish == "stop" else finish)

    def _tool_chunks(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """Text is held until its choice ends; then its content, its calls and its finish."""
        self.collect(deltas)
        out = []
        for d in deltas:
            if d.finish_reason is None:
                continue
            message, finish = self._message(d.index)
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": j, **c}
                                       for j, c in enumerate(delta["tool_calls"])]
            for part in ({"content": delta["content"]} if delta.get("content") else None,
                         {"tool_calls": delta["tool_calls"]} if "tool_calls" in delta else None):
                if part is not None:
                    out.append(self._envelope(self.object_chunk, [
                        {"index": d.index, "delta": part, "logprobs": None,
                         "finish_reason": None, "stop_reason": None}]))
            out.append(self._envelope(self.object_chunk, [  # the choice's ids, held too
                {"index": d.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                 "stop_reason": d.stop_reason, **self._token_ids(self._ids[d.index])}]))
        return out

    def _logprobs_obj(self, entries: list[LogprobEntry] | None) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        content = []
        for tok, lp, top in entries or ():
            content.append({**self._token(tok, lp), "top_logprobs": [
                self._token(t, v) for t, v in top.items()]})
        return {"content": content}

    def _token(self, tok: int, lp: float) -> dict[str, Any]:
        text = self.logprob_token(tok)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return x if math.isfinite(x) else -9999.0
