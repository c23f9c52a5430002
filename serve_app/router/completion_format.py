"""The completion endpoint's response: ``text_completion`` chunks and body, with echo,
logprobs in OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset) and
vLLM's prompt logprobs and token ids."""

from __future__ import annotations

from typing import Any

from serve_app.protocol.prompt_logprobs import Prompt, echo_logprobs, prompt_logprobs_json
from serve_app.router.responses import Decoder, Formatter, finite
from serve_app.router.streams import Delta, LogprobEntry, Usage


class CompletionFormat(Formatter):
    object_chunk = object_final = "text_completion"

    def __init__(self, response_id: str, model: str, tokenizer: Decoder | None,
                 num_choices: int, system_fingerprint: str | None = None, *,
                 echo_texts: list[str] | None = None, want_logprobs: bool = False, n: int = 1,
                 echo_logprobs: int | None = None, prompt_logprobs: bool = False,
                 prompt_token_ids: list[list[int]] | None = None) -> None:
        super().__init__(response_id, model, tokenizer, num_choices, system_fingerprint)
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

    def _logprobs_obj(self, entries: list[LogprobEntry] | None,
                      offset: int) -> dict[str, Any] | None:
        if not self._want_logprobs:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for tok, lp, top in entries or ():
            text = self.logprob_token(tok)
            tokens.append(text)
            token_lps.append(finite(lp))
            tops.append({self.logprob_token(t): finite(v) for t, v in top.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}
