"""A stalled Worker end to end on one local Ray cluster.

A step hung past ``step_timeout_s`` (2 s here): its requests get OpenAI's 503 naming the stall
(the JSON body, and an SSE error event on a stream that had begun), Serve's health check
(``health_check_period_s`` 0.5 s) fails three times and Serve replaces the replica, and a new
request is then served by the new one.

The hang is test code: ``HangingWorker`` wraps its engine's ``step`` so that it waits while a
file exists (at most 60 s). Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import httpx
import pytest
from ray import serve
from ray.serve import Deployment

from serve_app.app import actor_options, worker_options
from serve_app.config import AppConfig
from serve_app.router.router import REPLICA_HEADER, Router
from serve_app.worker.worker import Worker, build_engine

from .cluster import local_ray, make_tiny_checkpoint, wait_until

pytestmark = pytest.mark.timeout(420)

STEP_TIMEOUT_S = 2.0
STALL = re.compile(r"engine stalled: step \d+ has run for \d+\.\ds, over step_timeout_s=2s; "
                   "this engine serves no more requests")


def _hang_while(engine: Any, path: str) -> Any:
    """``engine`` (an ``AsyncEngine``) whose steps wait while ``path`` exists."""
    step = engine.engine.step

    def hanging_step() -> Any:
        deadline = time.monotonic() + 60
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return step()

    engine.engine.step = hanging_step
    return engine


class HangingWorker(Worker):
    def __init__(self, config: AppConfig, hang_file: str) -> None:
        super().__init__(config, engine_factory=lambda c: _hang_while(build_engine(c), hang_file))


@pytest.fixture(scope="module")
def hang_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stall") / "hang"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def url(tmp_path_factory, hang_file):
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
    cfg = AppConfig(model=str(model), dtype="float32", max_model_len=256,
                    kv_cache_memory_bytes=8 << 20, num_threads=1, accelerator="cpu",
                    worker_num_cpus=0.1, router_num_cpus=0.1, step_timeout_s=STEP_TIMEOUT_S,
                    health_check_period_s=0.5, routing_stats_period_s=0.5)
    worker = serve.deployment(name="Worker")(HangingWorker).options(**worker_options(cfg))
    router = cast(Deployment, Router).options(
        num_replicas=1, ray_actor_options=actor_options(cfg, cfg.router_num_cpus))
    with local_ray() as base:
        serve.run(router.bind(worker.bind(cfg, str(hang_file)), cfg), name="stall",
                  route_prefix="/")
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 120, "healthy")
        yield base


def _complete(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": "The engine", "max_tokens": 4, "temperature": 0})


def _stream_events(url: str) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
            "prompt": "The engine", "max_tokens": 4, "stream": True}) as r:
        return r.status_code, [line.removeprefix("data: ") for line in r.iter_lines()
                               if line.startswith("data: ")]


def test_a_stalled_worker_answers_503_and_serve_replaces_it(url, hang_file):
    ok = _complete(url)
    assert ok.status_code == 200, ok.text
    stalled_replica = ok.headers[REPLICA_HEADER]
    hang_file.touch()
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # both reach the engine before its step outlives 2 s
        plain, streamed = pool.submit(_complete, url), pool.submit(_stream_events, url)
        plain_r, (status, events) = plain.result(), streamed.result()
    assert time.monotonic() - start < STEP_TIMEOUT_S + 10
    assert plain_r.status_code == 503, plain_r.text
    error = plain_r.json()["error"]
    assert error["type"] == "service_unavailable_error" and STALL.fullmatch(error["message"])
    assert status == 200 and events[-1] == "[DONE]"  # the stream had begun: an SSE error event
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and STALL.fullmatch(error["message"])
    hang_file.unlink()

    def served_elsewhere() -> bool:
        r = _complete(url)
        return r.status_code == 200 and r.headers[REPLICA_HEADER] != stalled_replica

    wait_until(served_elsewhere, 120, "a new Worker replica serves")
