"""The Router's settings: the OpenAI protocol's options and limits, authentication, the dynamic
batcher, admission control and replica choice (prefix affinity). ``AppConfig`` has them as
fields of its own."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from serve_app.metrics.names import MetricsNaming


class RouterSettings(BaseModel):
    """The Router replicas' fields of ``AppConfig``."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    served_model_name: str | None = Field(
        None, description="Name clients use in the `model` field; defaults to the engine's name "
        "for the model (its path, or 'pagedserve-default')."
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None, description="How `tool_choice=\"auto\"` reads tool calls in the model's text "
        "(vLLM's --tool-call-parser): hermes (Hermes, Qwen2.5) or llama3_json (Llama 3.1). "
        "Without it, requests with tools need tool_choice 'required', a named function or 'none'."
    )
    metrics_naming: MetricsNaming = Field(
        "pagedserve", description="Names of the exported metrics: pagedserve's own "
        "(pagedserve_*, labels model_name and replica) or vllm (vLLM's names as Ray Serve LLM "
        "exports them: vllm_*, labels model_name, engine and ReplicaId)."
    )
    chat_template: str | None = Field(
        None, description="The chat template to use instead of the tokenizer's (vLLM's "
        "--chat-template): a file's path, read when the app is built, or the Jinja template "
        "itself. Requests pass variables to it with chat_template_kwargs."
    )
    num_routers: int = Field(1, ge=1, description="Router (HTTP ingress) replicas.")
    max_batch_size: int = Field(
        32, ge=1, description="The Router's batcher sends a batch as soon as this many requests "
        "wait. 1 (with batch_wait_ms=0) dispatches one handle call per request."
    )
    batch_wait_ms: float = Field(
        2.0, ge=0.0, le=1000.0, description="Longest time, in milliseconds, the oldest waiting "
        "request is held before its batch is sent. Requests wait only while an earlier batch is "
        "on its way to a Worker; one arriving when none is goes at once."
    )
    max_waiting_requests: int = Field(
        1024, ge=1, description="Bound on a Router replica's waiting queue: requests accepted but "
        "without a first token yet. Requests beyond it get 429 with Retry-After."
    )
    ttft_slo_s: float | None = Field(
        None, gt=0.0, description="Time-to-first-token objective (seconds) for admission by "
        "predicted wait: a request whose predicted queue wait (what waits ahead of it over the "
        "Workers' finished requests/s, plus the start still to go while no Worker runs) is over "
        "it gets 429 with a computed Retry-After; while a Worker starts and the prediction meets "
        "it, the request is held. None = off; max_waiting_requests is a hard cap either way."
    )
    max_request_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest accepted HTTP request body; larger ones "
        "get 413."
    )
    max_n: int = Field(
        16, ge=1, le=1024, description="Largest `n` (choices per prompt) a request may ask "
        "for; more gets 400. Each choice is a sequence holding its own KV blocks."
    )
    max_tokens_limit: int | None = Field(
        None, ge=1, description="Largest `max_tokens` (`max_completion_tokens`) a request may "
        "ask for; more gets 400, and a request without one gets at most this many. None = "
        "only max_model_len bounds it."
    )
    api_key: SecretStr | None = Field(
        None, description="When set, /v1/* routes need `Authorization: Bearer <api_key>` (401 "
        "otherwise). Never logged."
    )
    api_key_file: str | None = Field(
        None, description="A file whose content (whitespace stripped) is the API key, e.g. a "
        "mounted Kubernetes Secret; read by each Router replica, so the key never travels in the "
        "app's arguments. Excludes api_key."
    )
    router_num_cpus: float = Field(0.5, ge=0.0, description="CPUs a Router replica reserves.")
    router_max_ongoing_requests: int = Field(
        4096, ge=1, description="Serve's cap on concurrent HTTP requests per Router replica "
        "(streams included); beyond it Serve's proxy queues them. Keep it above "
        "max_waiting_requests plus the streams you expect, so the Router's 429 decides."
    )
    prefix_chunk_tokens: int = Field(
        32, ge=1, description="Granularity of the prompt-prefix hashes used for prefix affinity."
    )
    prefix_min_match_tokens: int = Field(
        64, ge=0, description="Shortest shared prefix (tokens, summed over a batch) for which a "
        "batch is routed to the replica that has it cached."
    )
    imbalance_threshold: int = Field(
        16, ge=0, description="Prefix affinity is overridden when the affine replica's load "
        "(requests running, waiting or in flight) exceeds the least loaded one's by more."
    )
    cold_start_timeout_s: float = Field(
        300.0, gt=0.0, description="With an autoscaling policy whose min_replicas is 0: how long "
        "the Router holds a request while no Worker runs and one is started, before it answers "
        "503."
    )
