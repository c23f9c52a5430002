"""What the Router and a Worker replica say to each other, as types.

A batch is one streaming ``Worker.generate_batch`` call carrying ``WorkerRequest``s. The call
streams back a ``StreamAttach`` first, then (unless it joined an open stream) one
``StepMessage`` per engine step with the parts of every request its stream carries (the
engine hands the Worker that step's record for the stream whole, ``engine.StepStream``; the
Worker's aborts come in a message of their own):

* ``TokenPart``: new tokens of one sequence of a request (and their logprobs);
* ``DonePart``: the request is finished at the Worker (normally, or aborted);
* ``ErrorPart``: the request failed (400 for bad input, 500 for an engine error).

A part's ``key`` names its request: its request id when the call named a ``stream_key`` (the
stream may carry the requests of several batches), else its position in the batch. The Router
hands the parts on to each request's handler as they came (``EngineRequest.events``).

NamedTuples pickle as tuples plus one reference to their class per message, so the wire stays
as compact as the plain tuples and lists it carried before these types.

The other calls' answers are TypedDicts: ``ModelInfo`` (``Worker.model_info``), ``WorkerStats``
(``Worker.get_stats``), and the two reports Serve collects from each Worker replica,
``RoutingStats`` (``record_routing_stats``, read by ``WorkerRequestRouter``) and
``AutoscalingStats`` (``record_autoscaling_stats``, read by ``QueueDepthPolicy``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, TypedDict

from engine import AsyncEngineStats, Logprobs, PromptLogprobs, SamplingParams

# Why the Router aborts a request at its Worker (``Worker.abort``'s ``reason``): the client
# left ("abort"), or a stop string matched ("stop"; the engine never sees stop strings). The
# Worker cancels the request's task with it as the message, and its metrics count it so.
AbortReason = Literal["abort", "stop"]

# ---- generate_batch ----------------------------------------------------------------------------


class WorkerRequest(NamedTuple):
    """One already-tokenized prompt of a batch."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class StreamAttach(NamedTuple):
    """The first message of every ``generate_batch`` call."""

    replica: str  # the Worker replica that took the batch (control calls name it)
    stream: str  # the id of the stream that carries the batch's requests
    attached: bool  # True: the batch joined that open stream, and this call ends here


class TokenPart(NamedTuple):
    key: int | str  # the request: its id, or its position in the batch
    seq_index: int  # which of the request's ``n`` sequences
    token_ids: list[int]  # new since the previous part
    finish_reason: str | None  # "stop" | "length" | "abort" on the sequence's last tokens
    logprobs: list[Logprobs] | None  # one per new token, when the request asked for them


class DonePart(NamedTuple):
    key: int | str
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked for them


class ErrorPart(NamedTuple):
    key: int | str
    status: int  # the HTTP status the Router answers with
    message: str


Part = TokenPart | DonePart | ErrorPart


class StepMessage(NamedTuple):
    """Everything one engine step produced for the requests of one stream.

    It pickles its parts as plain tuples: Serve sends every message through cloudpickle, whose
    Python hook runs once for each object that is not a plain tuple, list or dict; a message of
    64 ``TokenPart``s took 215 us to dump that way, against 15 us as plain tuples."""

    tokens: list[TokenPart]
    done: list[DonePart]
    errors: list[ErrorPart]

    def __reduce__(self) -> tuple[Any, tuple[list[tuple[Any, ...]], ...]]:
        return _step_message, (list(map(tuple, self.tokens)), list(map(tuple, self.done)),
                               list(map(tuple, self.errors)))

    @property
    def num_finished(self) -> int:
        """Requests it ends."""
        return len(self.done) + len(self.errors)


def _step_message(tokens: list[tuple[Any, ...]], done: list[tuple[Any, ...]],
                  errors: list[tuple[Any, ...]]) -> StepMessage:
    """A ``StepMessage`` from its pickled form (``StepMessage.__reduce__``)."""
    return StepMessage(list(map(TokenPart._make, tokens)), list(map(DonePart._make, done)),
                       list(map(ErrorPart._make, errors)))


WorkerMessage = StreamAttach | StepMessage


# ---- control calls and reports -----------------------------------------------------------------


class ModelInfo(TypedDict):
    """``Worker.model_info``: what the Router needs to prepare prompts."""

    replica: str
    model_name: str
    max_model_len: int
    vocab_size: int  # token ids the engine accepts: [0, vocab_size) (config.json's, not the
    #                  tokenizer's length, which may be smaller)
    dtype: str  # the activations' dtype in use, e.g. "float32"
    quantization: str | None  # the weights' format ("int8", "compressed-tensors:int8-w8a8",
    #                           ...), or None (in dtype)
    kv_cache_dtype: str  # what the KV cache holds: "fp8_e4m3" or the dtype's name
    default_sampling: dict[str, Any]  # for fields a request leaves unset: the
    #                  generation config's (SamplingParams' names: temperature, max_tokens, ...)
    tokenizer: Any  # the model's Hugging Face tokenizer


class WorkerStats(AsyncEngineStats):
    """``Worker.get_stats``: the engine's stats and the replica's own counters."""

    replica: str
    requests_total: int
    aborted_total: int  # requests aborted here: a control call, or the Router closed their stream
    rss_bytes: int  # the replica process's resident memory
    batches_total: int
    batches_running: int
    demand: DemandStats  # what this replica reports to the autoscaler of demand and finishes


class RoutingStats(TypedDict):
    """``Worker.record_routing_stats``. ``WorkerRequestRouter`` reads it with defaults: a
    replica has none before its first report."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    received: dict[str, int]  # requests received per ``stream_key`` (per Router)
    stopped: bool  # its engine stalled or stopped: it answers 503 until Serve replaces it
    finished_per_s: float  # requests finished here per second (the Routers' drain rate)


class DemandStats(TypedDict):
    """What a Worker adds to its autoscaling stats from ``serve_app.router.demand``: its finished
    requests per second and the Routers' demand (sums over their fresh reports, 0.0 with none;
    the names are ``serve_app.autoscaling.signals``' FINISHED_PER_S and DEMAND_*)."""

    finished_per_s: float  # requests finished on the replica per second, over 10 s
    demand_arrivals_per_s: float  # requests the Routers accepted per second (n choices count n)
    demand_prompt_tokens_per_s: float
    demand_router_waiting: float  # accepted by the Routers, not handed to a Worker yet


class AutoscalingStats(DemandStats):
    """``Worker.record_autoscaling_stats``, the metrics ``QueueDepthPolicy`` reads by name."""

    num_waiting: float
    num_running: float
    kv_cache_usage: float  # share of KV-cache blocks in use, 0..1
    seq_slot_usage: float  # running sequences / max_num_seqs
    output_tokens_per_s: float
