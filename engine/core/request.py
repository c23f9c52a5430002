"""One sequence being generated: its tokens, how many have KV in the cache, its blocks."""

from __future__ import annotations

import enum
import time

from engine.core.outputs import Logprobs, PromptLogprobs
from engine.core.sampling_params import SamplingParams
from engine.grammar.compiler import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    """A sequence. ``n > 1`` requests become one ``Request`` per sample, the first (``index`` 0)
    being the parent whose prompt blocks its siblings share once its prompt is computed.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the scheduler's only rule is
    to let it catch up with ``num_tokens``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        index: int = 0,
        group_id: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else eos_token_ids
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        self.logprobs: list[Logprobs] = []
        self.stop_reason: int | str | None = None
        self.siblings: list[Request] = []  # on the parent: the others of its group
        self.parent: Request | None = None  # on a sibling: waits to share its prompt blocks
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None  # first admitted to a batch
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        self.grammar: GrammarState | None = None  # with structured_outputs: its matcher
        self.bad_words: list[list[int]] = []  # the token ids of params.bad_words
        # with params.prompt_logprobs, on the first of the n: the prompt tokens' scored so far
        self.prompt_logprobs: PromptLogprobs = (
            [None] if params.prompt_logprobs is not None and index == 0 else [])

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, logprobs: Logprobs | None) -> None:
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)

    def check_stop(self, max_model_len: int) -> bool:
        """After a new token: set a finished status if a stop condition holds."""
        last = self.all_token_ids[-1]
        n_out = self.num_output_tokens
        if n_out >= self.params.min_tokens and last in self.stop_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last if last in self.params.stop_token_ids else None  # EOS: None
        elif self.grammar is not None and self.grammar.terminated:
            self.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
        elif (self.params.max_tokens is not None and n_out >= self.params.max_tokens) or (
            self.num_tokens >= max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH
        return self.finished

    def stop_at_string(self, stop_str: str) -> None:
        """A stop string completed with the last token: the sequence is finished."""
        self.status = RequestStatus.FINISHED_STOPPED
        self.stop_reason = stop_str

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_ids}, {self.status.value})")


def group_metrics(seqs: list[Request], finished_time: float) -> dict[str, float]:
    """Timings (``time.monotonic()`` seconds) and token counts of a finished request's sequences,
    for ``RequestOutput.metrics``: the earliest first-scheduled and first-token times of the
    ``n`` sequences, their generated tokens summed. A time is absent when it never happened (a
    request aborted before it was scheduled or produced a token)."""
    metrics = {"arrival_time": seqs[0].arrival_time, "finished_time": finished_time,
               "num_prompt_tokens": float(seqs[0].num_prompt_tokens),
               "num_generation_tokens": float(sum(s.num_output_tokens for s in seqs)),
               "num_preemptions": float(sum(s.num_preemptions for s in seqs))}
    scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    if scheduled:
        metrics["first_scheduled_time"] = min(scheduled)
    first = [s.first_token_time for s in seqs if s.first_token_time is not None]
    if first:
        metrics["first_token_time"] = min(first)
    return metrics
