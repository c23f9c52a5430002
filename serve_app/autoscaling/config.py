"""Autoscaling policy files: ``deploy/autoscaling/*.yaml`` -> a validated ``AutoscalingPolicyConfig``.

``AppConfig.autoscaling`` (``build_app({"autoscaling": ...})``, ``serve run serve_app:build_app
autoscaling=...``, a Serve config's ``args``) takes one of:

* a bundled policy's name, e.g. ``latency_first``: ``deploy/autoscaling/latency_first.yaml``,
  found beside the package (``Path(serve_app.__file__).parents[1] / "deploy" / "autoscaling"``,
  so it works in a checkout, an editable install and the Docker image, which copies ``deploy/``);
* the path of a policy file (anything with a ``/`` or ending in ``.yaml`` / ``.yml``);
* a mapping with the same fields, given inline (the Helm chart's ``autoscaling.inline``).

A bad policy (unknown field, out-of-range value, min above max) is a ``ValueError`` at start-up
naming the file, the field and the reason.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

POLICY_FUNCTION = "serve_app.autoscaling.policy:QueueDepthPolicy"
POLICY_DIR = Path(__file__).resolve().parents[2] / "deploy" / "autoscaling"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
DEFAULT_PANIC_WINDOW_S = 6.0
POLICY_FIELDS = ("target_queue_per_replica", "max_kv_usage", "downscale_threshold",
                 "replica_start_s", "panic_window_s", "panic_threshold", "standby_replicas",
                 "predictive_floor", "trend_window_s")


class AutoscalingPolicyConfig(BaseModel):
    """One autoscaling policy for the Worker deployment (``QueueDepthPolicy`` plus Serve's own
    bounds, delays and metric windows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["queue_depth", "serve_default"] = Field(
        "queue_depth", description="'queue_depth': serve_app.autoscaling.policy:QueueDepthPolicy and "
        "the fields below. 'serve_default': Ray Serve's own policy (ongoing handle calls per "
        "replica against target_ongoing_requests; one call carries a Router's whole batch), "
        "with the bounds, delays and windows below, for comparison."
    )
    target_ongoing_requests: float = Field(
        2.0, gt=0, description="With policy 'serve_default': Serve's target of ongoing calls "
        "per replica (its default is 2)."
    )
    min_replicas: int = Field(
        1, ge=0, description="Fewest Worker replicas. 0 lets the deployment scale to zero after "
        "idle_timeout_s; the Router then holds the next request (up to cold_start_timeout_s) "
        "while a Worker starts."
    )
    max_replicas: int = Field(4, ge=1, description="Most Worker replicas.")
    initial_replicas: int | None = Field(
        None, ge=0, description="Replicas started at deploy time; min_replicas when not set."
    )
    target_queue_per_replica: float = Field(
        4.0, gt=0, description="Requests waiting for a scheduler slot, per replica, above which "
        "replicas are added (batch calls queued at the Routers count too)."
    )
    max_kv_usage: float = Field(
        0.9, gt=0, le=1, description="How full a replica may be, on average, before replicas "
        "are added even with no queue: the larger of its KV-cache usage (fraction of blocks in "
        "use) and its sequence-slot usage (running requests / max_num_seqs)."
    )
    downscale_threshold: float = Field(
        0.5, gt=0, lt=1, description="Replicas are removed only down to a count at which the "
        "queue per replica and the usage stay below this fraction of "
        "target_queue_per_replica and max_kv_usage (the hysteresis band)."
    )
    replica_start_s: float = Field(
        30.0, ge=0, description="Seconds from a scale-up decision to a new Worker serving (what "
        "load_tests/start_time.py measures): a burst is sized for the backlog that builds "
        "meanwhile, and the trend floor looks this far ahead."
    )
    panic_window_s: float | None = Field(
        None, gt=0, description="Short window beside look_back_period_s: the Routers' arrival "
        "rate over it is compared with the long window's to detect a burst. Not set: 6 s, or "
        "half of look_back_period_s where that is shorter."
    )
    panic_threshold: float = Field(
        2.0, gt=1, description="A burst: the short window's arrival rate at least this many "
        "times the long window's. Nothing scales down during a burst and for one "
        "look_back_period_s after it."
    )
    standby_replicas: int = Field(
        0, ge=0, description="Warm capacity, in replicas, kept idle beside the load for 15 "
        "minutes after each burst: started and loaded Workers the Router sends nothing until "
        "every other Worker is full, so a burst is served at once while replacements start. "
        "Smooth traffic keeps none."
    )
    predictive_floor: Literal["none", "trend"] = Field(
        "none", description="'trend': never fewer replicas than the arrival rate's linear trend "
        "over trend_window_s, extrapolated replica_start_s ahead, needs (for slow ramps)."
    )
    trend_window_s: float = Field(
        120.0, gt=0, description="Window of the arrival-rate trend (predictive_floor: trend)."
    )
    upscale_delay_s: float = Field(
        5.0, ge=0, description="How long the policy must keep asking for more replicas before "
        "Serve adds them."
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="How long the queue must stay short and the cache not full "
        "(the policy asking for fewer replicas without a break) before Serve removes replicas."
    )
    idle_timeout_s: float = Field(
        300.0, ge=0, description="With min_replicas 0: how long the Workers must be idle (no "
        "request waiting or running) before the last replica is removed."
    )
    look_back_period_s: float = Field(
        10.0, gt=0, description="Window over which each replica's reports are averaged."
    )
    metrics_interval_s: float = Field(
        2.0, gt=0, description="How often replicas and Router handles send their metrics to "
        "Serve's controller; keep it below look_back_period_s."
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingPolicyConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas: {self.min_replicas} is above max_replicas "
                             f"({self.max_replicas})")
        init = self.initial_replicas
        if init is not None and not self.min_replicas <= init <= self.max_replicas:
            raise ValueError(f"initial_replicas: {init} is outside [min_replicas, max_replicas] "
                             f"= [{self.min_replicas}, {self.max_replicas}]")
        if self.standby_replicas >= self.max_replicas:
            raise ValueError(f"standby_replicas: {self.standby_replicas} leaves no active replica "
                             f"within max_replicas ({self.max_replicas})")
        if self.panic_window_s is not None and self.panic_window_s >= self.look_back_period_s:
            raise ValueError(f"panic_window_s: {self.panic_window_s} must be below "
                             f"look_back_period_s ({self.look_back_period_s})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"look_back_period_s: {self.look_back_period_s} must be above "
                             f"metrics_interval_s ({self.metrics_interval_s})")
        return self

    def policy_kwargs(self) -> dict[str, Any]:
        """``QueueDepthPolicy``'s constructor arguments."""
        kwargs = {name: getattr(self, name) for name in POLICY_FIELDS}
        if self.panic_window_s is None:
            kwargs["panic_window_s"] = min(DEFAULT_PANIC_WINDOW_S, self.look_back_period_s / 2)
        return kwargs

    def serve_autoscaling_config(self) -> dict[str, Any]:
        """The Worker deployment's ``autoscaling_config`` (``ray.serve.config.AutoscalingConfig``
        fields)."""
        cfg: dict[str, Any] = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "downscale_to_zero_delay_s": self.idle_timeout_s,
            "look_back_period_s": self.look_back_period_s,
            "metrics_interval_s": self.metrics_interval_s,
        }
        if self.policy == "serve_default":
            cfg["target_ongoing_requests"] = self.target_ongoing_requests
        else:
            cfg["policy"] = {"policy_function": POLICY_FUNCTION,
                             "policy_kwargs": self.policy_kwargs()}
        if self.initial_replicas is not None:
            cfg["initial_replicas"] = self.initial_replicas
        return cfg


def bundled_policies() -> list[str]:
    """Names of the policies in ``deploy/autoscaling/``."""
    return sorted(p.stem for p in POLICY_DIR.glob("*.yaml"))


def load_policy(spec: str | Path | dict[str, Any] | AutoscalingPolicyConfig,
                ) -> AutoscalingPolicyConfig:
    """A policy from a bundled name, a file path or an inline mapping (see the module doc)."""
    if isinstance(spec, AutoscalingPolicyConfig):
        return spec
    if isinstance(spec, dict):
        return _validate(spec, "inline autoscaling policy")
    if not isinstance(spec, (str, Path)):
        raise ValueError(f"autoscaling: expected a policy name, a file path or a mapping, got "
                         f"{type(spec).__name__}")
    path = _resolve(str(spec))
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the policy file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of policy fields, got "
                         f"{type(data).__name__}")
    return _validate(data, str(path))


def _resolve(spec: str) -> Path:
    if "/" in spec or spec.endswith((".yaml", ".yml")):
        return Path(spec).expanduser()
    if not _NAME.match(spec):
        raise ValueError(f"autoscaling: {spec!r} is neither a policy name nor a .yaml path")
    path = POLICY_DIR / f"{spec}.yaml"
    if not path.is_file():
        raise ValueError(f"autoscaling: no bundled policy {spec!r} in {POLICY_DIR} (bundled: "
                         f"{', '.join(bundled_policies()) or 'none'}); give a file path instead")
    return path


def _validate(data: dict[str, Any], source: str) -> AutoscalingPolicyConfig:
    try:
        return AutoscalingPolicyConfig.model_validate(data)
    except ValidationError as exc:
        raise ValueError("; ".join(_describe(source, e) for e in exc.errors())) from None


def _describe(source: str, error: Any) -> str:
    """``<file>: <field>: <reason>`` for one pydantic error."""
    field = ".".join(str(p) for p in error["loc"])
    reason = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        known = ", ".join(AutoscalingPolicyConfig.model_fields)
        return f"{source}: {field}: unknown field (known fields: {known})"
    if field:
        return f"{source}: {field}: {reason} (got {error.get('input')!r})"
    return f"{source}: {reason}"  # a model-level check; its message starts with the field
