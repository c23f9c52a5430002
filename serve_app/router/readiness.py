"""The Router's side of its Workers' readiness: learning the model from a Worker, the health
answer, and holding requests while the Workers scale up from zero.

``WorkerReadiness`` is a base class of the ``Router`` deployment (``serve_app/router/router.py``),
as ``RouterEndpoints`` is: its methods use the Router's fields named below, which the Router's
``__init__`` sets. ``Router._ready`` asks it to wait; ``Admission`` (``_admit(None)``) decides
first whether a held request may wait at all.
"""

from __future__ import annotations

import asyncio
import logging
import time

from serve_app.config import AppConfig
from serve_app.router.prompts import PromptProcessor
from serve_app.router.worker_client import WorkerClient

logger = logging.getLogger("ray.serve")


class WorkerReadiness:
    """Whether a Worker has loaded the model, and bringing one up for a held request."""

    cfg: AppConfig
    workers: WorkerClient
    prompts: PromptProcessor | None  # the model's, once a Worker reported it
    _init_task: asyncio.Task[None]  # ``_load_model_info``, started by the Router
    _waking: asyncio.Task[None] | None  # brings a Worker up from zero replicas
    _health: tuple[float, bool]  # (checked at, healthy): answered for a second

    async def _load_model_info(self) -> None:
        """Fetch the tokenizer and limits from a Worker, retrying until one is up."""
        while True:
            try:
                info = await asyncio.wait_for(self.workers.model_info(), timeout=10.0)
                self.prompts = p = PromptProcessor.for_app(info, self.cfg)
                logger.info("serving %s (dtype %s, weights %s, KV cache %s, max_model_len %d, "
                            "vocab_size %d)", p.model_name, p.dtype, p.quantization or p.dtype,
                            p.kv_cache_dtype or p.dtype, p.max_model_len, p.vocab_size)
                return
            except Exception as exc:  # no Worker yet, or it is still loading its model
                logger.info("waiting for a Worker to report its model: %r", exc)
                await asyncio.sleep(1.0)

    async def _wait_for_worker(self) -> None:
        """Hold requests while the Workers are scaled to zero, up to ``cold_start_timeout_s``.

        A handle call queued for a deployment with no replica makes Serve start one at once
        (its cold-start path); the call ends when that replica answers. Requests that arrive
        meanwhile share the wait. After a timeout, ``_ready`` answers 503.
        """
        if self._waking is None or self._waking.done():
            self._waking = asyncio.get_running_loop().create_task(
                asyncio.wait_for(self._wake_worker(), self.cfg.cold_start_timeout_s))
        try:
            await asyncio.shield(self._waking)
        except Exception as exc:  # timed out, or the Worker failed to start
            logger.warning("no Worker came up for a held request: %r", exc)

    async def _wake_worker(self) -> None:
        while self.prompts is None or not self.workers.replicas():
            if self.prompts is None:
                await asyncio.shield(self._init_task)
            else:
                await self.workers.model_info()  # queued until a Worker replica runs
                await asyncio.sleep(0.05)

    async def _healthy(self) -> bool:
        checked_at, ok = self._health
        if time.monotonic() - checked_at < 1.0:
            return ok
        ok = self.prompts is not None and bool(await self.workers.stats(timeout_s=2.0))
        if self.prompts is not None and self.cfg.scales_to_zero() and not self.workers.replicas():
            ok = True  # scaled to zero on purpose: the next request starts a Worker
        self._health = (time.monotonic(), ok)
        return ok
