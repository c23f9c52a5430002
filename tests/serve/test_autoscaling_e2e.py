"""Autoscaling end to end on one local Ray cluster: the default model, Workers of 0.1 CPU.

* A burst takes the Worker deployment from 1 to 2 replicas; light load continues while it
  returns to 1 (so a replica is removed while requests run), and every request sent during the
  whole run completes (HTTP 200, all its tokens).
* With ``min_replicas: 0`` the Workers go to zero when idle, and the next request is held by
  the Router while a Worker starts, then answered.

Short windows and delays (``metrics_interval_s`` 0.5, ``downscale_delay_s`` 3) keep each test
within about a minute; every wait is bounded.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve

from serve_app import build_app

from .cluster import local_ray, wait_until

pytestmark = pytest.mark.timeout(420)

MAX_TOKENS = 24  # per burst request; the trickle's are longer, so some run during removal
LONG_TOKENS = 480
COMMON = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 16 << 20,
          "num_threads": 1, "accelerator": "cpu", "worker_num_cpus": 0.1,
          "router_num_cpus": 0.1, "routing_stats_period_s": 0.5,
          "max_num_seqs": 4}  # a burst of 10 streams queues 6 on one replica
FAST = {"target_queue_per_replica": 2, "max_kv_usage": 0.9, "downscale_threshold": 0.7,
        "upscale_delay_s": 0, "downscale_delay_s": 3, "look_back_period_s": 2,
        "metrics_interval_s": 0.5}


@pytest.fixture(scope="module")
def base():
    from engine.models.default_model import default_model_path

    default_model_path()  # build it once here, not in each Worker
    with local_ray() as url:
        yield url


def worker_replicas(app: str) -> dict[str, int]:
    states = serve.status().applications[app].deployments["Worker"].replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items()}


def running(app: str) -> int:
    return worker_replicas(app).get("RUNNING", 0)


class Load:
    """``streams`` threads each sending completions back to back until stopped."""

    def __init__(self, url: str, streams: int, tokens: int = MAX_TOKENS) -> None:
        self.url, self.tokens, self.results, self._stop = url, tokens, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(streams)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                result = complete(client, self.url, f"stream {i} says", self.tokens)
                self.results.append((result, (200, self.tokens)))

    def stop(self) -> list[tuple[tuple, tuple]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=150)
        assert not any(t.is_alive() for t in self._threads), "a request did not finish"
        return self.results


def complete(client: httpx.Client, url: str, prompt: str,
             tokens: int = MAX_TOKENS) -> tuple[int, int | str]:
    """(status, completion tokens or the error text)."""
    try:
        resp = client.post(f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0})
    except httpx.HTTPError as exc:
        return -1, repr(exc)
    if resp.status_code != 200:
        return resp.status_code, resp.text
    return 200, resp.json()["usage"]["completion_tokens"]


def assert_all_complete(results: list[tuple[tuple, tuple]]) -> None:
    """Each (result, expected) pair matches: HTTP 200 with every requested token."""
    failed = [got for got, want in results if got != want]
    assert results and not failed, f"{len(failed)} of {len(results)} failed: {failed[:5]}"


def served_by_each(url: str) -> list[int]:
    stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
    return [w["requests_total"] for w in stats["workers"]]


def test_burst_scales_up_then_back_down_without_losing_a_request(base):
    policy = {**FAST, "min_replicas": 1, "max_replicas": 2}
    serve.run(build_app({**COMMON, "autoscaling": policy}), name="burst", route_prefix="/")
    wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 120, "healthy")
    assert running("burst") == 1
    start = time.monotonic()

    burst = Load(base, streams=10)
    wait_until(lambda: running("burst") >= 2, 120, "a second Worker")
    scaled_up = time.monotonic() - start
    # the new replica takes batches before the burst ends
    wait_until(lambda: (lambda s: len(s) == 2 and min(s) > 0)(served_by_each(base)), 60,
               "both Workers serving")
    trickle = Load(base, streams=2, tokens=LONG_TOKENS)  # running while a replica goes
    results = burst.stop()
    wait_until(lambda: worker_replicas("burst") == {"RUNNING": 1}, 120, "back to one Worker")
    scaled_down = time.monotonic() - start
    time.sleep(1.0)
    results += trickle.stop()

    assert_all_complete(results)
    assert running("burst") == 1
    print(f"1 -> 2 after {scaled_up:.1f}s, -> 1 after {scaled_down:.1f}s, "
          f"{len(results)} requests")
    serve.delete("burst")


def test_scales_to_zero_and_holds_the_next_request_while_a_worker_starts(base):
    policy = {**FAST, "min_replicas": 0, "max_replicas": 1, "initial_replicas": 1,
              "idle_timeout_s": 1}
    serve.run(build_app({**COMMON, "autoscaling": policy}), name="zero", route_prefix="/")
    wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 120, "healthy")
    with httpx.Client(timeout=150) as client:
        assert complete(client, base, "warm") == (200, MAX_TOKENS)
        wait_until(lambda: running("zero") == 0 and not worker_replicas("zero"), 60,
                   "zero Workers")
        assert httpx.get(f"{base}/health").status_code == 200  # idle on purpose, not broken
        start = time.monotonic()
        assert complete(client, base, "cold") == (200, MAX_TOKENS)
        held = time.monotonic() - start
    assert running("zero") == 1
    print(f"cold start held the request {held:.1f}s")
    serve.delete("zero")
