"""The chat endpoint's response: ``chat.completion`` chunks (a role chunk first, finish
reasons in a chunk of their own) and body, logprobs in OpenAI's chat shape, and tool calls
parsed out of the text when the request has a tool plan."""

from __future__ import annotations

from typing import Any

from serve_app.protocol.prompt_logprobs import Prompt, prompt_logprobs_json
from serve_app.protocol.tools import ToolPlan
from serve_app.router.responses import Decoder, Formatter, finite
from serve_app.router.streams import Delta, LogprobEntry, Usage


class ChatFormat(Formatter):
    object_chunk = "chat.completion.chunk"
    object_final = "chat.completion"

    def __init__(self, response_id: str, model: str, tokenizer: Decoder | None,
                 num_choices: int, system_fingerprint: str | None = None, *,
                 want_logprobs: bool = False, tools: ToolPlan | None = None,
                 prompt_logprobs: bool = False,
                 prompt_token_ids: list[list[int]] | None = None) -> None:
        super().__init__(response_id, model, tokenizer, num_choices, system_fingerprint)
        self._prompt_ids = prompt_token_ids
        self._want_logprobs = want_logprobs
        self._prompt_logprobs = prompt_logprobs  # the response's prompt_logprobs field
        self._tools = tools  # text is held back and parsed for calls when a choice ends

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return [self.role_chunk(num_choices)]

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
        return {"token": text, "logprob": finite(lp), "bytes": list(text.encode("utf-8"))}
