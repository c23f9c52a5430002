"""After the model: each request's ``n`` sequences as one group, every new token detokenized
(stop strings end a sequence here), and the ``RequestOutput`` a step or an abort returns
(cumulative, delta or final, per the request's ``output_kind``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.detokenizer import TextStream
from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.request import Request, group_metrics
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

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, RequestGroup] = {}

    def add(self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
            seqs: list[Request]) -> None:
        streams = [TextStream(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                              params.skip_special_tokens) if params.detokenize else None
                   for _ in seqs]
        self.groups[request_id] = RequestGroup(request_id, prompt, ids, params, seqs, streams,
                                               [0] * params.n, [""] * params.n)

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
