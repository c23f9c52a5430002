"""The serving application's settings, one validated pydantic model (``AppConfig``, in ``app``)
made of the Router's fields (``router``) and the Workers' (``replicas``) beside the engine's
``EngineConfig``. May import ``autoscaling.config``, ``protocol``, ``metrics.names`` and the
engine's front door."""

from serve_app.config.app import AppConfig

__all__ = ["AppConfig"]
