"""The serving application's settings: one validated pydantic model.

``serve run serve_app:build_app model=/m dtype=bfloat16 num_workers=2`` and the ``args:`` of a
Serve config file both arrive here. Keys that belong to the engine (``model``, ``dtype``,
``max_model_len``, ``block_size``, ...) may be given flat, as on the command line, or nested under
``engine:``; everything else is a serving setting. Values from the CLI are strings and pydantic
coerces them; an unknown key or a bad value is a ``ValueError`` at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from engine import EngineConfig
from serve_app.autoscaling.config import load_policy
from serve_app.config.replicas import ReplicaSettings
from serve_app.config.router import RouterSettings
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


class AppConfig(RouterSettings, ReplicaSettings):
    """Everything ``build_app`` needs: the engine's settings and the serving layer's (the
    Router's fields in ``RouterSettings``, the Workers' in ``ReplicaSettings``)."""

    # no error message repeats the input: it may hold the API key
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    engine: EngineConfig = Field(
        default_factory=EngineConfig,
        description="Engine settings (model, dtype, max_model_len, cache, scheduler, device). "
        "Its keys may also be given flat, e.g. model=/path dtype=bfloat16.",
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
