"""One Worker replica with ``tensor_parallel_size=2`` on a local Ray cluster (CPU bundles, gloo):
rank 1 is a Ray actor in the replica's placement group. It answers HTTP like the offline
engine; a killed rank actor fails the requests in flight and gets the replica replaced; no rank
actor outlives ``serve.shutdown()``."""

from __future__ import annotations

import threading

import httpx
import pytest
import ray
from ray import serve

from serve_app import build_app

from .cluster import local_ray, make_tiny_checkpoint, wait_until

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 512
PROMPTS = ["Hello, my name is", "The quick brown fox"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-tp")))


@pytest.fixture(scope="module")
def url(model_path):
    app = build_app({"model": model_path, "dtype": "float32", "max_model_len": MAX_MODEL_LEN,
                     "kv_cache_memory_bytes": 8 << 20, "num_threads": 1, "accelerator": "cpu",
                     "tensor_parallel_size": 2, "router_num_cpus": 0.5,
                     "health_check_period_s": 1.0, "routing_stats_period_s": 0.5})
    with local_ray(num_cpus=6) as base:
        serve.run(app, name="tp", route_prefix="/")
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 60, "healthy")
        yield base


def rank_actors() -> list[tuple[str, str]]:
    """(name, namespace) of every live tensor-parallel rank actor."""
    return sorted((a["name"], a["namespace"])
                  for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("pagedserve-tp-"))


def worker_replica(url: str) -> str:
    (worker,) = httpx.get(f"{url}/v1/stats", timeout=30).json()["workers"]
    return worker["replica"]


def complete(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_answers_like_the_offline_engine(url, model_path):
    from engine import LLM, SamplingParams

    offline = LLM(model=model_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory_bytes=8 << 20, num_threads=1)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        resp = complete(url, prompt)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == exp.outputs[0].text
    stream = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True})
    assert stream.text.rstrip().endswith("data: [DONE]")
    ((name, _),) = rank_actors()
    assert name.endswith("-rank1") and worker_replica(url) in name


def test_a_killed_rank_fails_in_flight_requests_and_the_replica_is_replaced(url):
    ((name, namespace),) = rank_actors()
    old_replica = worker_replica(url)
    chunks: list[str] = []
    first_chunk = threading.Event()

    def stream_long_request():
        body = {"prompt": PROMPTS[0], "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                chunks.append(line)
                first_chunk.set()

    reader = threading.Thread(target=stream_long_request, daemon=True)
    reader.start()
    assert first_chunk.wait(60)
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    reader.join(60)
    assert not reader.is_alive(), "the request in flight hung"
    text = "\n".join(chunks)
    assert '"error"' in text and "tensor-parallel" in text, text[-500:]

    wait_until(lambda: worker_replica(url) != old_replica, 120, "a new Worker replica")
    wait_until(lambda: complete(url, PROMPTS[1]).status_code == 200, 120, "requests served")
    ((new_name, _),) = wait_until(lambda: len(a := rank_actors()) == 1 and a, 30,
                                  "one rank actor")
    assert new_name != name


def test_rank_actors_are_gone_after_serve_shutdown(url):
    assert len(rank_actors()) == 1
    serve.shutdown()
    wait_until(lambda: rank_actors() == [], 60, "rank actors gone")
