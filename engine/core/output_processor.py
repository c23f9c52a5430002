"""After the model: each request's ``n`` sequences as one group, every new token detokenized
(stop strings end a sequence here), and the ``RequestOutput`` a step or an abort returns
(cumulative, delta or final, per the request's ``output_kind``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.detokenizer import TextStream
from engine.core.outputs import CompletionOutput, Logprobs, RequestOutput
from engine.core.request import Request, RequestStatus, group_metrics
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RequestGroup:
    """The ``n`` sequences of one request and what has been reported of them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    streams: list[TextStream | None]
    sent_tokens: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # (delta outputs carry them once)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class OutputProcessor:
    """The engine's requests by id, and what each has to report."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.groups: dict[str, RequestGroup] = {}
        self.generation_tokens = 0  # tokens appended to sequences, ever

    def add(self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
            seqs: list[Request]) -> None:
        streams = [TextStream(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                              params.skip_special_tokens) if params.detokenize else None
                   for _ in seqs]
        self.groups[request_id] = RequestGroup(request_id, prompt, ids, params, seqs, streams,
                                               [0] * params.n, [""] * params.n)

    def process_step(self, reqs: list[Request], token_ids: list[int],
                     logprobs: list[Logprobs | None], on_finished: Callable[[Request], None],
                     fail: Callable[[str, Exception], None]) -> list[RequestOutput]:
        """A step's sampled tokens (``token_ids[i]`` for ``reqs[i]``) appended to their
        sequences, stops checked and text detokenized; returns the outputs of the groups the
        step touched and forgets the finished ones. ``on_finished`` frees a sequence that ended;
        a sequence that raises fails its own group only (``fail``)."""
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for i, req in enumerate(reqs):
            if req.group_id not in self.groups:
                continue  # its group failed earlier in this step
            try:
                if self._append(req, token_ids[i], logprobs[i], now):
                    on_finished(req)
            except Exception as e:  # fail this request only
                fail(req.group_id, e)
                touched.pop(req.group_id, None)
                continue
            touched[req.group_id] = self.groups[req.group_id]
        outputs = [out for g in touched.values() if (out := self.make_output(g)) is not None]
        for g in touched.values():
            if g.finished:
                del self.groups[g.request_id]
        return outputs

    def _append(self, req: Request, token: int, logprobs: Logprobs | None, now: float) -> bool:
        """Whether ``req`` finished with ``token``."""
        if req.params.max_tokens == 0:  # the prompt only (say, for its logprobs): no token
            req.status = RequestStatus.FINISHED_LENGTH
            return True
        req.append_token(token, logprobs)
        self.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        return self.detokenize(req, token, req.check_stop(self.max_model_len))

    def detokenize(self, req: Request, token: int, finished: bool) -> bool:
        """Add ``req``'s new ``token`` to its text; returns whether the sequence is finished
        (``finished``: by its own stop checks; or a stop string this token completed)."""
        group = self.groups[req.group_id]
        stream = group.streams[req.index]
        if stream is None:
            return finished
        text, stop_str = stream.add([token])
        if stop_str is not None and not finished:
            req.stop_at_string(stop_str)
            finished = True
        if finished:
            text += stream.finish()
        group.pending_text[req.index] += text
        return finished

    def make_output(self, g: RequestGroup) -> RequestOutput | None:
        """What ``g`` reports now (None: nothing new, or a final-only request not finished)."""
        kind = g.params.output_kind
        if kind == "final" and not g.finished:
            return None
        outs = []
        for seq in g.seqs:
            sent = g.sent_tokens[seq.index]
            if kind == "delta" and sent == seq.num_output_tokens and not seq.finished:
                continue
            outs.append(self._completion(g, seq, delta=kind == "delta"))
            g.sent_tokens[seq.index] = seq.num_output_tokens
        metrics = group_metrics(g.seqs, time.monotonic()) if g.finished else {}
        first = g.seqs[0]
        prompt_lps = first.prompt_logprobs if len(first.prompt_logprobs) == len(
            g.prompt_token_ids) and not (kind == "delta" and g.prompt_logprobs_sent) else None
        g.prompt_logprobs_sent |= prompt_lps is not None
        return RequestOutput(g.request_id, g.prompt_token_ids, outs, g.finished, g.prompt,
                             num_cached_tokens=first.num_cached_tokens, metrics=metrics,
                             prompt_logprobs=prompt_lps)

    @staticmethod
    def _completion(g: RequestGroup, seq: Request, delta: bool) -> CompletionOutput:
        start = g.sent_tokens[seq.index] if delta else 0
        stream = g.streams[seq.index]
        if delta:
            text, g.pending_text[seq.index] = g.pending_text[seq.index], ""
        else:
            text = stream.emitted_text if stream is not None else ""
        logprobs = seq.logprobs[start:] if g.params.logprobs is not None else None
        finish = seq.status.value if seq.finished else None
        return CompletionOutput(seq.index, seq.output_token_ids[start:], text, logprobs, finish,
                                seq.stop_reason)
