"""The serving application's settings: one validated pydantic model.

``serve run serve_app:build_app model=/m dtype=bfloat16 num_workers=2`` and the ``args:`` of a
Serve config file both arrive here. Keys that belong to the engine (``model``, ``dtype``,
``max_model_len``, ``block_size``, ...) may be given flat, as on the command line, or nested under
``engine:``; everything else is a serving setting. Values from the CLI are strings and pydantic
coerces them; an unknown key or a bad value is a ``ValueError`` at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from engine import EngineConfig
from serve_app.autoscaling.config import AutoscalingPolicyConfig, load_policy
from serve_app.metrics.names import MetricsNaming
from serve_app.protocol.chat_template import load_chat_template


def _engine_keys() -> set[str]:
    """The flat names of the engine's settings: the fields of EngineConfig's sections."""
    keys: set[str] = set()
    for field in EngineConfig.model_fields.values():
        section = field.annotation  # each a pydantic model; FieldInfo types it optional
        if isinstance(section, type) and issubclass(section, BaseModel):
            keys.update(section.model_fields)
    return keys


_ENGINE_KEYS = _engine_keys()


class AppConfig(BaseModel):
    """Everything ``build_app`` needs: the engine's settings and the serving layer's."""

    # no error message repeats the input: it may hold the API key
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Engine settings (model, dtype, max_model_len, cache, scheduler, device). "
        "Its keys may also be given flat, e.g. model=/path dtype=bfloat16.",
    )
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
    num_workers: int = Field(1, ge=1, description="Worker replicas, each owning one engine.")
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
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="What a Worker asks Ray for: 'gpu' = one GPU per tensor-parallel rank, "
        "'cpu' = worker_num_cpus CPUs; 'auto' = gpu when the cluster (or this machine) has GPUs "
        "and the engine's device is not 'cpu'."
    )
    worker_num_cpus: float = Field(
        1.0, gt=0.0, description="CPUs a Worker replica (each rank on GPU) reserves from Ray."
    )
    router_num_cpus: float = Field(0.5, ge=0.0, description="CPUs a Router replica reserves.")
    serve_fast_path: bool = Field(
        True, description="Ray Serve's lighter request path for the Router and Worker replicas: "
        "their code runs on the replica's main event loop (no hop to a second thread), request "
        "logs are buffered, and the Router streams from Workers over Serve's gRPC transport "
        "rather than Ray actor calls. False keeps Serve's defaults."
    )
    router_max_ongoing_requests: int = Field(
        4096, ge=1, description="Serve's cap on concurrent HTTP requests per Router replica "
        "(streams included); beyond it Serve's proxy queues them. Keep it above "
        "max_waiting_requests plus the streams you expect, so the Router's 429 decides."
    )
    worker_max_ongoing_requests: int = Field(
        1024, ge=1, description="Serve's cap on concurrent handle calls per Worker (batches and "
        "control calls); admission control is the Router's max_waiting_requests."
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
    routing_stats_period_s: float = Field(
        1.0, gt=0.0, description="How often Serve collects each Worker's load for routing."
    )
    health_check_period_s: float = Field(
        5.0, gt=0.0, description="How often Serve checks that a Worker's engine is alive and "
        "no step has run past step_timeout_s; three failed checks in a row replace the Worker."
    )
    autoscaling: AutoscalingPolicyConfig | None = Field(
        None, description="Worker autoscaling policy (serve_app.autoscaling.policy:QueueDepthPolicy): "
        "a bundled policy's name (latency_first, throughput_first, scale_to_zero: "
        "deploy/autoscaling/<name>.yaml), the path of a policy file, or a mapping of the same "
        "fields. None = a fixed num_workers replicas."
    )
    cold_start_timeout_s: float = Field(
        300.0, gt=0.0, description="With an autoscaling policy whose min_replicas is 0: how long "
        "the Router holds a request while no Worker runs and one is started, before it answers "
        "503."
    )
    worker_drain_timeout_s: float = Field(
        300.0, gt=0.0, description="How long a Worker replica being removed (scale-down, "
        "redeploy) may keep streaming the batches it holds before Serve stops it "
        "(Serve's graceful_shutdown_timeout_s); it takes no new batches meanwhile."
    )

    @model_validator(mode="before")
    @classmethod
    def _nest_engine_keys(cls, data: Any) -> Any:
        """Move flat engine keys (model=..., dtype=...) under ``engine``."""
        if not isinstance(data, dict):
            return data
        flat = {k: v for k, v in data.items() if k in _ENGINE_KEYS}
        engine = data.get("engine")
        if not flat and not isinstance(engine, dict):
            return data
        rest = {k: v for k, v in data.items() if k not in _ENGINE_KEYS}
        rest["engine"] = EngineConfig.from_kwargs(**{**_flat_engine(engine), **flat})
        return rest

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, value: SecretStr | None) -> SecretStr | None:
        """An empty key would turn authentication off (a request without the header compares
        equal): refuse it rather than serve unauthenticated while looking guarded."""
        key = None if value is None else value.get_secret_value()
        if key is not None and not key.strip():
            raise ValueError("must not be empty or whitespace; leave api_key unset to serve "
                             "without authentication")
        if key is not None and key != key.strip():
            raise ValueError("must not start or end with whitespace (HTTP strips it from the "
                             "Authorization header, so no request could match)")
        return value

    @model_validator(mode="after")
    def _one_key_source(self) -> AppConfig:
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("api_key and api_key_file are mutually exclusive: give one")
        return self

    def resolved_api_key(self) -> str | None:
        """The API key from ``api_key`` or ``api_key_file``; ``ValueError`` naming the file if it
        is missing or empty."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_file is None:
            return None
        try:
            key = Path(self.api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"api_key_file {self.api_key_file!r} cannot be read: "
                             f"{e.strerror}") from None
        if not key:
            raise ValueError(f"api_key_file {self.api_key_file!r} is empty")
        return key

    @field_validator("chat_template")
    @classmethod
    def _load_chat_template(cls, value: str | None) -> str | None:
        """A file's path -> its text (a template stays as it is), checked to parse."""
        return None if value is None else load_chat_template(value)

    @field_validator("autoscaling", mode="before")
    @classmethod
    def _load_autoscaling(cls, value: Any) -> Any:
        """A policy name, file path or mapping -> the validated policy (errors name the file)."""
        return None if value is None else load_policy(value)

    @model_validator(mode="after")
    def _one_way_to_size_workers(self) -> AppConfig:
        if self.autoscaling is not None and "num_workers" in self.model_fields_set:
            raise ValueError("num_workers: set either num_workers (a fixed count) or "
                             "autoscaling (min_replicas..max_replicas), not both")
        return self

    def scales_to_zero(self) -> bool:
        """Whether the Worker deployment may have no replica (autoscaling min_replicas 0)."""
        return self.autoscaling is not None and self.autoscaling.min_replicas == 0

    def use_gpu(self) -> bool:
        """Whether Worker replicas ask for GPUs (resolves ``accelerator='auto'``)."""
        if self.accelerator != "auto":
            return self.accelerator == "gpu"
        if self.engine.device.device == "cpu":
            return False
        if self.engine.device.device == "cuda":
            return True
        return _cluster_has_gpus()

    def worker_threads(self, cores: int | None = None) -> int:
        """torch intra-op threads for a Worker on the CPU: ``num_threads`` when set, else the
        cores this process may use (``cores``, default: its CPU affinity) shared evenly by the
        Workers (``num_workers``, or the autoscaling maximum), and at least
        ``worker_num_cpus``. One Worker on a machine takes all its cores: the Router and Ray's
        own processes mostly wait on I/O, and a Worker held to one thread of two cores ran at
        0.38x vLLM's tokens/s."""
        if self.engine.device.num_threads is not None:
            return self.engine.device.num_threads
        workers = self.num_workers if self.autoscaling is None else self.autoscaling.max_replicas
        return max(int(self.worker_num_cpus),
                   self.engine.device.cpu_threads(share=workers, cores=cores))


def _flat_engine(engine: Any) -> dict[str, Any]:
    """Engine settings in flat form, from None, an EngineConfig, or a nested or flat dict."""
    if engine is None:
        return {}
    if isinstance(engine, EngineConfig):
        return engine.flat()
    nested = all(k in EngineConfig.model_fields and isinstance(v, dict) for k, v in engine.items())
    return EngineConfig(**engine).flat() if nested and engine else dict(engine)


def _cluster_has_gpus() -> bool:
    import ray

    if ray.is_initialized():
        # ray.cluster_resources has no annotations (Ray 2.60): a dict of resource -> amount
        resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        return resources.get("GPU", 0) > 0
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
