"""The Worker replicas' settings: how many (a fixed count or an autoscaling policy), what each
reserves from Ray, Serve's options for them, health checks and draining. ``AppConfig`` has
them as fields of its own."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app.autoscaling.config import AutoscalingPolicyConfig


class ReplicaSettings(BaseModel):
    """The Worker replicas' fields of ``AppConfig``."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    num_workers: int = Field(1, ge=1, description="Worker replicas, each owning one engine.")
    accelerator: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="What a Worker asks Ray for: 'gpu' = one GPU per tensor-parallel rank, "
        "'cpu' = worker_num_cpus CPUs; 'auto' = gpu when the cluster (or this machine) has GPUs "
        "and the engine's device is not 'cpu'."
    )
    worker_num_cpus: float = Field(
        1.0, gt=0.0, description="CPUs a Worker replica (each rank on GPU) reserves from Ray."
    )
    serve_fast_path: bool = Field(
        True, description="Ray Serve's lighter request path for the Router and Worker replicas: "
        "their code runs on the replica's main event loop (no hop to a second thread), request "
        "logs are buffered, and the Router streams from Workers over Serve's gRPC transport "
        "rather than Ray actor calls. False keeps Serve's defaults."
    )
    worker_max_ongoing_requests: int = Field(
        1024, ge=1, description="Serve's cap on concurrent handle calls per Worker (batches and "
        "control calls); admission control is the Router's max_waiting_requests."
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
    worker_drain_timeout_s: float = Field(
        300.0, gt=0.0, description="How long a Worker replica being removed (scale-down, "
        "redeploy) may keep streaming the batches it holds before Serve stops it "
        "(Serve's graceful_shutdown_timeout_s); it takes no new batches meanwhile."
    )
