"""Per-HTTP-request decoding: the Worker's parts -> text deltas per choice.

One ``ResponseStream`` reads the shared event queue of an HTTP request's engine requests (one
per prompt; the Worker's ``serve_app.wire`` parts), detokenizes each choice incrementally with
``TextStream``, cuts at stop strings (asking the Router to abort the request at its Worker once
every choice has stopped) and counts usage. Choice ``k`` of prompt ``p`` has index
``p * n + k``, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine import Logprobs, PromptLogprobs, TextStream
from serve_app.protocol.errors import APIError
from serve_app.router.batch import EngineRequest
from serve_app.wire import AbortReason, DonePart, Part, TokenPart

# (token id, its logprob, top logprobs {token id: logprob}) per generated token
LogprobEntry = tuple[int, float, dict[int, float]]


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None
    stop_reason: int | str | None = None  # the stop string or stop_token_ids id that ended it


@dataclass
class _Choice:
    index: int
    text: TextStream
    num_tokens: int = 0
    finish_reason: str | None = None
    stopped_on_string: bool = False  # the engine does not know: it keeps generating
    stop_reason: int | str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class ResponseStream:
    requests: list[EngineRequest]
    tokenizer: Any  # the model's Hugging Face tokenizer
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    num_logprobs: int | None
    # stop listening; aborts at the Worker if running, saying why
    release: Callable[[EngineRequest, AbortReason], None]
    usage: Usage = field(default_factory=Usage)

    def __post_init__(self) -> None:
        self._choices: dict[tuple[int, int], _Choice] = {}
        self._pos = {id(r): p for p, r in enumerate(self.requests)}
        self._stopped: set[int] = set()  # prompts whose choices all stopped on a string
        # per prompt: its token ids and, when asked for, their logprobs (at its DonePart)
        self.prompt_logprobs: list[tuple[list[int], PromptLogprobs | None]] = [
            (r.prompt_token_ids, None) for r in self.requests]
        self.usage.prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)
        self.n = self.requests[0].params.n
        for p, r in enumerate(self.requests):
            for k in range(self.n):
                ts = TextStream(self.tokenizer, r.prompt_token_ids, stop=self.stop,
                                include_stop_str_in_output=self.include_stop_str_in_output,
                                skip_special_tokens=self.skip_special_tokens)
                self._choices[(p, k)] = _Choice(p * self.n + k, ts)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """Deltas of everything that arrived together; ends when every request is done.

        Raises ``APIError`` if a request failed at the Worker.
        """
        queue = self.requests[0].events
        pending = len(self.requests)
        while pending:
            out: list[Delta] = []
            item: tuple[EngineRequest, Part] | None = await queue.get()
            while item is not None:
                pending -= self._apply(*item, out)
                item = queue.get_nowait() if not queue.empty() else None
            if out:
                yield _merge(out)

    def _apply(self, request: EngineRequest, part: Part, out: list[Delta]) -> int:
        """Apply one part; return 1 when it ends its request for this stream, else 0."""
        p = self._pos[id(request)]
        if p in self._stopped:
            return 0  # stopped on a string already: late tokens, or the abort's echo
        if isinstance(part, TokenPart):
            delta = self._tokens(p, part)
            if delta is not None:
                out.append(delta)
            if self._all_stopped(p):
                self._stopped.add(p)
                self.release(request, "stop")  # every choice stopped on a string: abort there
                return 1
            return 0
        if isinstance(part, DonePart):
            self.usage.cached_tokens += part.num_cached_tokens
            self.prompt_logprobs[p] = (self.requests[p].prompt_token_ids, part.prompt_logprobs)
            out.extend(self._close_open_choices(p))
            return 1
        raise APIError(part.status, part.message)

    def _tokens(self, p: int, part: TokenPart) -> Delta | None:
        choice = self._choices[(p, part.seq_index)]
        if choice.finish_reason is not None:
            return None  # already stopped on a string; the abort is on its way
        token_ids, finish = part.token_ids, part.finish_reason
        choice.num_tokens += len(token_ids)
        self.usage.completion_tokens += len(token_ids)
        text, stop_str = choice.text.add(token_ids)
        if stop_str is not None:
            choice.finish_reason, choice.stop_reason = "stop", stop_str
            choice.stopped_on_string = finish is None
        elif finish is not None:
            text += choice.text.finish()
            choice.finish_reason = "length" if finish == "length" else "stop"
            if finish == "stop" and token_ids and \
                    token_ids[-1] in self.requests[p].params.stop_token_ids:
                choice.stop_reason = token_ids[-1]  # the engine's rule: EOS is no stop_reason
        entries = _entries(token_ids, part.logprobs, self.num_logprobs)
        return Delta(choice.index, text, list(token_ids), choice.finish_reason, entries,
                     choice.stop_reason)

    def _all_stopped(self, p: int) -> bool:
        """Every choice is done here, and some only here (on a stop string)."""
        choices = [self._choices[(p, k)] for k in range(self.n)]
        return all(c.finish_reason for c in choices) and any(c.stopped_on_string
                                                             for c in choices)

    def _close_open_choices(self, p: int) -> list[Delta]:
        """Choices the Worker finished without a finish reason on the last tokens."""
        out = []
        for k in range(self.n):
            choice = self._choices[(p, k)]
            if choice.finish_reason is None:
                choice.finish_reason = "stop"
                out.append(Delta(choice.index, choice.text.finish(), [], "stop"))
        return out


def _merge(deltas: list[Delta]) -> list[Delta]:
    """One delta per choice: events drained together may hold several steps of one choice."""
    by_index: dict[int, Delta] = {}
    for d in deltas:
        prev = by_index.get(d.index)
        if prev is None:
            by_index[d.index] = d
            continue
        prev.text += d.text
        prev.token_ids += d.token_ids
        prev.finish_reason = d.finish_reason or prev.finish_reason
        prev.stop_reason = d.stop_reason if d.stop_reason is not None else prev.stop_reason
        if d.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + d.logprobs
    return list(by_index.values())


def _entries(token_ids: list[int], logprobs: list[Logprobs] | None,
             num: int | None) -> list[LogprobEntry] | None:
    if num is None or logprobs is None:
        return None
    out = []
    for tok, lps in zip(token_ids, logprobs, strict=False):
        top = dict(sorted(lps.items(), key=lambda kv: -kv[1])[:num]) if num else {}
        out.append((tok, lps.get(tok, float("-inf")), top))
    return out
