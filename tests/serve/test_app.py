"""The real app on a real local Ray cluster, over real HTTP (the official ``openai`` client too).

One cluster for the module, three applications deployed together:
``/`` two Workers; ``/guarded`` an API key, a waiting-queue bound of 2, a 4 KiB body limit,
int8 weights;
``/broken`` a Worker that cannot load its model (for 503).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
from ray import serve

from serve_app import build_app

from .cluster import local_ray, make_tiny_checkpoint, wait_until
from .test_tools import install_tool_template

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 256
API_KEY = "test-key-123"
PROMPTS = ["Hello, my name is", "The quick brown fox", "Paris is the capital of",
           "Tokens are generated one at a time"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
    return str(install_tool_template(path))  # the Hermes way (tests/serve/test_tools.py)


@pytest.fixture(scope="module")
def url(model_path):
    common = {"model": model_path, "dtype": "float32", "max_model_len": MAX_MODEL_LEN,
              "kv_cache_memory_bytes": 8 << 20, "num_threads": 1, "accelerator": "cpu",
              "router_num_cpus": 0.5, "routing_stats_period_s": 0.5}
    main = build_app({**common, "num_workers": 2, "max_batch_size": 16, "batch_wait_ms": 5})
    guarded = build_app({**common, "api_key": API_KEY, "max_waiting_requests": 2,
                         "max_request_body_bytes": 4096, "max_batch_size": 1,
                         "batch_wait_ms": 0, "quantization": "int8", "kv_cache_dtype": "fp8"})
    broken = build_app({**common, "model": "/nonexistent/model", "worker_num_cpus": 0.5})
    with local_ray() as base:
        serve.run_many([serve.RunTarget(main, name="main", route_prefix="/"),
                        serve.RunTarget(guarded, name="guarded", route_prefix="/guarded"),
                        serve.RunTarget(broken, name="broken", route_prefix="/broken")],
                       wait_for_applications_running=False)
        for name in ("main", "guarded"):  # every replica up, not just the first Worker
            wait_until(lambda n=name: serve.status().applications[n].status == "RUNNING",
                       180, f"app {name} running")
        for prefix in ("", "/guarded"):
            wait_until(lambda p=prefix: httpx.get(f"{base}{p}/health").status_code == 200,
                       60, f"{prefix or '/'} healthy")
        wait_until(lambda: len(_stats(base)["workers"]) == 2, 30, "both Workers known")
        yield base


@pytest.fixture(scope="module")
def offline(model_path):
    from engine import LLM

    return LLM(model=model_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
               kv_cache_memory_bytes=8 << 20, num_threads=1)


def _client(url: str, prefix: str = "", key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}{prefix}/v1", api_key=key, max_retries=0, timeout=60)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _stats(url: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=30).json()


# ---- availability (first: the broken app is deleted afterwards) ------------------------------

def test_503_when_no_worker_is_healthy(url):
    wait_until(lambda: httpx.get(f"{url}/broken/health").status_code == 503, 60, "broken router")
    _error(httpx.get(f"{url}/broken/health"), 503)
    resp = httpx.post(f"{url}/broken/v1/completions", json={"prompt": "hi"})
    assert "Worker" in _error(resp, 503)["message"]
    serve.delete("broken", _blocking=False)


def test_health_models_and_request_ids(url, model_path):
    assert httpx.get(f"{url}/health").status_code == 200
    models = _client(url).models.list()
    assert [m.id for m in models.data] == [model_path]
    assert [m.model_extra["dtype"] for m in models.data] == ["float32"]  # the dtype in use
    assert [m.model_extra["quantization"] for m in models.data] == [None]
    assert [m.model_extra["kv_cache_dtype"] for m in models.data] == ["float32"]
    resp = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": "my-id-1"},
                      json={"prompt": "hi", "max_tokens": 2})
    assert resp.headers.get_list("x-request-id") == ["my-id-1"]
    assert resp.json()["id"].endswith("my-id-1")
    err = httpx.post(f"{url}/v1/completions", json={"prompt": 5})
    assert len(err.headers.get_list("x-request-id")) == 1


def test_http_arrives_through_haproxy(url):
    # build_app before Ray started chose Serve's high-throughput ingress: HAProxy on Serve's
    # port, forwarding to the Router replicas' own HTTP servers (Serve keeps a Python proxy on
    # a side port only as HAProxy's fallback)
    import ray

    classes = set()
    for a in ray.util.list_named_actors(all_namespaces=True):
        try:
            actor = ray.get_actor(a["name"], namespace=a["namespace"])
        except ValueError:  # gone since listed: the broken app's replica, being deleted
            continue
        classes.add(actor._ray_actor_creation_function_descriptor.class_name)
    assert "HAProxyManager" in classes
    # serve_app's other start-up defaults reached the processes: HAProxy's thread count
    # follows the CPUs (``use_fast_ingress``), and the replicas and HAProxy run at niceness 0
    # rather than Ray's 15 for its workers (``serve_at_normal_priority``)
    port = url.rsplit(":", 1)[1]
    ours = [p for p in _processes() if "ServeReplica:main:" in p[1]
            or ("haproxy" in p[1] and _haproxy_port(p[1]) == port)]
    # a replica's title is ``ray::ServeReplica:main:Worker`` between calls and gains the
    # method's name (``...Worker.record_routing_stats``) while Ray runs one
    names = {"haproxy" if "haproxy" in cmd else cmd.split()[0].split(".")[0] for _, cmd in ours}
    assert names == {"haproxy", "ray::ServeReplica:main:Router", "ray::ServeReplica:main:Worker"}
    assert {pid: os.getpriority(os.PRIO_PROCESS, pid) for pid, _ in ours} == \
        {pid: 0 for pid, _ in ours}
    for _, cmd in ours:
        if "haproxy" in cmd:
            assert f"nbthread {os.environ['RAY_SERVE_HAPROXY_NBTHREAD']}\n" in _haproxy_config(cmd)
    # and Serve's controller loops every 0.5 s, the log monitor globs every 0.5 s
    # (``pace_background_work``)
    for process, setting in (("ray::ServeController", b"RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5"),
                             ("ray/_private/log_monitor.py",
                              b"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0")):
        pids = [pid for pid, cmd in _processes() if process in cmd]
        assert len(pids) == 1, process
        assert setting in Path(f"/proc/{pids[0]}/environ").read_bytes().split(b"\0")


def _processes() -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, ValueError):
            continue
        if d.name.isdigit() and cmd:
            out.append((int(d.name), cmd))
    return out


def _haproxy_config(cmd: str) -> str:
    args = cmd.split()
    return Path(args[args.index("-f") + 1]).read_text() if "-f" in args else ""


def _haproxy_port(cmd: str) -> str | None:
    """The HTTP port of the HAProxy with command line ``cmd`` (on 127.0.0.1)."""
    section = ""
    for line in _haproxy_config(cmd).splitlines():
        parts = line.split()
        if line[:1].strip():
            section = line.strip()
        elif section == "frontend http_frontend" and parts[:1] == ["bind"] \
                and parts[1].startswith("127.0.0.1:"):
            return parts[1].rsplit(":", 1)[1]
    return None


# ---- results equal the offline engine's ------------------------------------------------------

def test_completions_match_offline_llm(url, model_path, offline):
    from engine import SamplingParams

    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)
    client = _client(url)
    batch = client.completions.create(model=model_path, prompt=PROMPTS, max_tokens=12,
                                      temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == \
        [e.outputs[0].text for e in expected]
    assert batch.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    for prompt, exp in zip(PROMPTS, expected, strict=True):
        chunks = list(client.completions.create(model=model_path, prompt=prompt, max_tokens=12,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
            exp.outputs[0].finish_reason


def test_chat_matches_offline_llm(url, model_path, offline):
    from engine import SamplingParams

    tok = offline.get_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    (exp,) = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    client = _client(url)
    resp = client.chat.completions.create(model=model_path, messages=messages,
                                          max_completion_tokens=10, temperature=0)
    assert resp.choices[0].message.content == exp.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == len(exp.outputs[0].token_ids)
    stream = list(client.chat.completions.create(
        model=model_path, messages=messages, max_completion_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        exp.outputs[0].text
    assert stream[-2].choices[0].finish_reason == exp.outputs[0].finish_reason
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == \
        len(exp.outputs[0].token_ids)


def test_chat_stream_wire_format(url):
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[1:-2])
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in chunks[:-1])
    body["stream_options"]["continuous_usage_stats"] = True  # vLLM's: usage on every chunk
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    chunks = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert counts[0] == 0 and counts[-1] == 6 and counts == sorted(counts)
    assert all(c["usage"]["prompt_tokens"] == prompt and c["usage"]["total_tokens"] ==
               prompt + c["usage"]["completion_tokens"] for c in chunks)


def test_stop_string_aborts_at_the_worker(url, offline):
    """Two prompts in one batch; the first stops on a string and is aborted at its replica
    by a control call while the second runs on."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    first, second = (o.outputs[0].text for o in offline.generate(PROMPTS[:2], params,
                                                                    use_tqdm=False))
    start = next(i for i in range(4, len(first) - 3) if first[i:i + 3] not in second)
    stop = first[start:start + 3]
    before = _stats(url)["total"]
    resp = _client(url).completions.create(model=None, prompt=PROMPTS[:2], max_tokens=60,
                                           temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [first[: first.index(stop)], second]
    assert [c.finish_reason for c in choices] == ["stop", "length"]
    after = wait_until(lambda: (s := _stats(url)["total"])["num_running"] == 0 and s, 20, "idle")
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 110


def test_n_echo_and_logprobs(url):
    client = _client(url)
    many = client.completions.create(model=None, prompt=PROMPTS[:2], max_tokens=4, n=3,
                                     temperature=1.0, seed=7, echo=True)
    assert sorted(c.index for c in many.choices) == list(range(6))
    assert all(c.text.startswith(PROMPTS[c.index // 3]) for c in many.choices)
    lp = client.completions.create(model=None, prompt=PROMPTS[1], max_tokens=5, logprobs=3,
                                   extra_body={"ignore_eos": True})
    assert len(lp.choices[0].logprobs.tokens) == 5
    # keyed by token text: distinct ids that decode alike (byte pieces) share a key
    assert all(1 <= len(top) <= 3 for top in lp.choices[0].logprobs.top_logprobs)
    chat = client.chat.completions.create(model=None, max_tokens=4, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True},
                                          messages=[{"role": "user", "content": "x"}])
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_echo_logprobs_and_prompt_logprobs_match_offline(url, offline):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 0) and
    vLLM's prompt_logprobs, against the offline engine's prompt logprobs."""
    from engine import SamplingParams

    prompt = PROMPTS[2]
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0.0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice, usage = resp.json()["choices"][0], resp.json()["usage"]
    ref = offline.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1),
                           use_tqdm=False)[0]
    ids, ref_lps, tok = ref.prompt_token_ids, ref.prompt_logprobs, offline.get_tokenizer()
    texts = [tok.decode([t]) for t in ids]
    assert (choice["text"], choice["finish_reason"], usage["completion_tokens"]) == \
        (prompt, "length", 0)
    lp = choice["logprobs"]
    assert lp["tokens"] == texts
    assert lp["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(ids))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [e[t].logprob for t, e in zip(ids[1:], ref_lps[1:], strict=True)], abs=1e-4)
    for top, t, e in zip(lp["top_logprobs"][1:], ids[1:], ref_lps[1:], strict=True):
        assert top == pytest.approx({tok.decode([i]): v.logprob for i, v in e.items()
                                     if i == t or v.rank <= 1}, abs=1e-4)
    out = _client(url).completions.create(model=None, prompt=ids, max_tokens=3,
                                          temperature=0.0, extra_body={"prompt_logprobs": 1})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for entry, e in zip(got[1:], ref_lps[1:], strict=True):
        assert set(entry) == {str(i) for i in e}
        for i, v in e.items():
            assert entry[str(i)]["rank"] == v.rank
            assert entry[str(i)]["decoded_token"] == tok.decode([i])
            assert entry[str(i)]["logprob"] == pytest.approx(v.logprob, abs=1e-4)
    chat = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "prompt_logprobs": 0})
    body = chat.json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1
               for e in body["prompt_logprobs"][1:])


def test_vllm_sampling_fields_match_offline(url, offline):
    """top_k 0, allowed_token_ids, bad_words and truncate_prompt_tokens give the offline
    engine's tokens; cache_salt keeps prefix caches apart."""
    from engine import SamplingParams

    client = _client(url)
    extra = {"top_k": 0, "allowed_token_ids": [300, 301, 302, 400, 401], "bad_words": ["x"],
             "truncate_prompt_tokens": 6, "ignore_eos": True}
    prompt = list(range(20, 40))
    out = client.completions.create(model=None, prompt=prompt, max_tokens=6, temperature=0.0,
                                    logprobs=0, extra_body=extra)
    ref = offline.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=6, temperature=0.0, **extra), use_tqdm=False)[0]
    assert out.usage.prompt_tokens == 6 and ref.prompt_token_ids == prompt[-6:]
    tok = offline.get_tokenizer()
    assert out.choices[0].logprobs.tokens == [tok.decode([t]) for t in ref.outputs[0].token_ids]
    assert out.choices[0].text == ref.outputs[0].text
    assert len(ref.outputs[0].token_ids) == 6
    assert set(ref.outputs[0].token_ids) <= set(extra["allowed_token_ids"])
    salted = list(range(500, 600))  # 6 full blocks of 16 to reuse; long enough for affinity
    cached, replicas = [], set()
    for salt in ("a", "a", "b"):
        resp = httpx.post(f"{url}/v1/completions", json={
            "prompt": salted, "max_tokens": 1, "cache_salt": salt}, timeout=60)
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        replicas.add(resp.headers["x-pagedserve-replica"])
    assert (cached, len(replicas)) == ([0, 96, 0], 1)


def test_logit_bias_as_openai_clients_send_it(url, offline):
    """The openai client's ``logit_bias`` (string keys) gives the offline engine's tokens for
    the same bias; a bias over the vocabulary or out of range is a 400 naming it."""
    from engine import SamplingParams

    client = _client(url)
    prompt = list(range(60, 75))
    plain = offline.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    bias = {plain[0]: -100.0, 401: 4.0, 402: -3.5}
    ref = offline.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias=bias), use_tqdm=False)[0]
    out = client.completions.create(model=None, prompt=prompt, max_tokens=5, temperature=0.0,
                                    logprobs=0, logit_bias={str(k): v for k, v in bias.items()},
                                    extra_body={"ignore_eos": True})
    tok = offline.get_tokenizer()
    assert ref.outputs[0].token_ids[0] != plain[0]
    assert out.choices[0].logprobs.tokens == [tok.decode([t]) for t in ref.outputs[0].token_ids]
    chat = client.chat.completions.create(model=None, max_tokens=3, temperature=0.0,
                                          messages=[{"role": "user", "content": "x"}],
                                          logit_bias={"77": 100})
    assert chat.choices[0].message.content == tok.decode([77] * 3)
    for bias_json, param in (({"100000": 1}, "logit_bias"), ({"5": 101}, "logit_bias.5")):
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "logit_bias": bias_json},
                          timeout=60)
        assert _error(resp, 400)["param"] == param


def test_return_token_ids_as_vllm_gives_them(url, offline):
    """``return_token_ids``: each completion choice has its prompt's ids and its own, the
    offline engine's tokens; a chat stream sends the prompt's ids first, then each chunk's.
    ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:<id>``."""
    from engine import SamplingParams

    client = _client(url)
    prompts = [list(range(80, 90)), list(range(90, 97))]
    out = client.completions.create(model=None, prompt=prompts, max_tokens=4, temperature=0.0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    refs = offline.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    got = [(c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]) for c in out.choices]
    assert got == [(p, list(r.outputs[0].token_ids)) for p, r in zip(prompts, refs, strict=True)]
    messages = [{"role": "user", "content": "Count: one two"}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    ref = offline.generate({"prompt_token_ids": ids}, SamplingParams(
        max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    chunks = list(client.chat.completions.create(
        model=None, messages=messages, max_tokens=5, temperature=0.0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    streamed = [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
    assert streamed == list(ref.token_ids)
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == ref.text
    plain = client.completions.create(model=None, prompt=prompts[0], max_tokens=1)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    named = client.completions.create(model=None, prompt=prompts[0], max_tokens=4, logprobs=2,
                                      echo=True, temperature=0.0, extra_body={
                                          "return_tokens_as_token_ids": True, "ignore_eos": True})
    lps = named.choices[0].logprobs
    assert lps.tokens == [f"token_id:{t}" for t in prompts[0] + list(refs[0].outputs[0].token_ids)]
    assert all(k.startswith("token_id:") for top in lps.top_logprobs[1:] for k in top)
    chat = client.chat.completions.create(model=None, messages=messages, max_tokens=2,
                                          logprobs=True, top_logprobs=1, temperature=0.0,
                                          extra_body={"return_tokens_as_token_ids": True,
                                                      "ignore_eos": True})
    assert [e.token for e in chat.choices[0].logprobs.content] == [
        f"token_id:{t}" for t in ref.token_ids[:2]]


# ---- concurrency -----------------------------------------------------------------------------

async def _stream_completion(client: httpx.AsyncClient, prefix: str, max_tokens: int,
                             headers: dict | None = None) -> tuple[int, int, str | None]:
    """(status, tokens counted from the streamed logprobs, replica) of one streaming request."""
    body = {"prompt": random.choice(PROMPTS) * random.randint(1, 6), "max_tokens": max_tokens,
            "ignore_eos": True, "logprobs": 0, "stream": True, "temperature": 0.8}
    async with client.stream("POST", f"{prefix}/v1/completions", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, 0, resp.headers.get("retry-after")
        tokens = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    tokens += len(choice["logprobs"]["tokens"])
        return 200, tokens, resp.headers.get("x-pagedserve-replica")


def test_64_concurrent_streams_on_two_workers(url):
    lengths = [random.Random(i).randint(1, 24) for i in range(64)]

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(_stream_completion(client, "", n) for n in lengths))

    results = asyncio.run(run())
    assert [r[0] for r in results] == [200] * 64
    assert [r[1] for r in results] == lengths
    workers = _stats(url)["workers"]
    assert len(workers) == 2
    assert {r[2] for r in results} == {w["replica"] for w in workers}  # both served
    assert all(w["requests_total"] > 0 for w in workers)


def test_overload_gets_429_and_accepted_requests_complete(url):
    headers = {"Authorization": f"Bearer {API_KEY}"}

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(_stream_completion(client, "/guarded", 16, headers)
                                          for _ in range(24)))

    results = asyncio.run(run())
    rejected = [r for r in results if r[0] == 429]
    accepted = [r for r in results if r[0] == 200]
    assert rejected and accepted and len(rejected) + len(accepted) == 24
    assert all(r[2] is not None and int(r[2]) >= 1 for r in rejected)  # Retry-After
    assert all(r[1] == 16 for r in accepted)


def _idle(workers) -> bool:
    return all(w["num_free_blocks"] == w["num_total_blocks"] and w["num_running"] == 0
               for w in workers)


def test_client_disconnect_frees_kv_blocks(url):
    """A stream the client drops is aborted at its Worker: the request stops generating there
    (it could run on to its max_tokens by itself: ignore_eos), the Worker counts the abort, and
    its KV blocks are free again."""
    idle = _idle
    wait_until(lambda: idle(_stats(url)["workers"]), 30, "workers idle")
    before = _stats(url)["total"]
    max_tokens = MAX_MODEL_LEN - 16  # the prompt is under 16 tokens
    body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            assert not idle(_stats(url)["workers"])  # it holds blocks while streaming
    after = wait_until(lambda: idle((s := _stats(url))["workers"]) and s["total"], 20,
                       "KV blocks freed after disconnect")
    assert after["aborted_total"] == before["aborted_total"] + 1
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < max_tokens


def test_prefix_affinity_follows_the_cached_prompt(url):
    """Two long prompts land on different replicas (the first is still running when the
    second arrives); follow-ups sharing either prefix go where that prefix is cached."""
    p1, p2 = list(range(10, 170)), list(range(200, 360))
    # Start from idle Workers whose routing reports say so: a report from the previous test
    # (a busy replica) lives up to a stats period (0.5 s) in the Router's request router.
    wait_until(lambda: _idle(_stats(url)["workers"]), 30, "workers idle")
    time.sleep(1.5)
    hits_before = _stats(url)["total"]["prefix_cache_hits"]
    with httpx.Client(base_url=url, timeout=60) as client:
        body = {"prompt": p1, "max_tokens": 80, "ignore_eos": True, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as first:
            next(first.iter_lines())
            second = client.post("/v1/completions", json={"prompt": p2, "max_tokens": 2})
        owners = {1: first.headers["x-pagedserve-replica"],
                  2: second.headers["x-pagedserve-replica"]}
        assert owners[1] != owners[2]  # least loaded: the first replica was busy
        for key, prompt in ((2, p2), (1, p1)):
            follow = client.post("/v1/completions", json={"prompt": prompt + [5, 6],
                                                          "max_tokens": 2})
            assert follow.headers["x-pagedserve-replica"] == owners[key]
    assert _stats(url)["total"]["prefix_cache_hits"] > hits_before


# ---- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "7"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": 0}', 400, "top_p"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400,
     "messages.0.role"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-17"}', 404, "model"),
    ("/v1/completions", b'{"prompt": "hi", "use_beam_search": true}', 400, "use_beam_search"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"guided_regex": "a+"}', 400, "guided_regex"),
    ("/v1/completions", b'{"prompt": "hi", "allowed_token_ids": [5, 100000]}', 400,
     "allowed_token_ids"),
    ("/v1/completions", b'{"prompt": "hi", "prompt_logprobs": 1, "stream": true}', 400,
     "prompt_logprobs"),
])
def test_invalid_requests(url, path, body, status, param):
    resp = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    err = _error(resp, status)
    assert err["param"] == param


def test_prompt_over_max_model_len(url):
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(5, 305))})
    message = _error(resp, 400)["message"]
    assert str(MAX_MODEL_LEN) in message and "300" in message
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": [5] * 250, "max_tokens": 10})
    assert "260" in _error(resp, 400)["message"]


def test_auth_and_body_limit(url):
    base = f"{url}/guarded"
    assert httpx.get(f"{base}/health").status_code == 200  # health needs no key
    assert _error(httpx.get(f"{base}/v1/models"), 401)["type"] == "authentication_error"
    bad = {"Authorization": "Bearer nope"}
    _error(httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}, headers=bad), 401)
    good = {"Authorization": f"Bearer {API_KEY}"}
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                    headers=good)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    big = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 8000}, headers=good)
    _error(big, 413)


def test_int8_fp8_kv_app_reports_and_matches_offline(url, model_path):
    from engine import LLM, SamplingParams

    key = {"Authorization": f"Bearer {API_KEY}"}
    card = httpx.get(f"{url}/guarded/v1/models", headers=key).json()["data"][0]
    assert (card["dtype"], card["quantization"], card["kv_cache_dtype"]) == \
        ("float32", "int8", "fp8_e4m3")
    llm = LLM(model=model_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
              kv_cache_memory_bytes=8 << 20, num_threads=1, quantization="int8",
              kv_cache_dtype="fp8")
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for prompt, exp in zip(PROMPTS, want, strict=True):
        resp = httpx.post(f"{url}/guarded/v1/completions", headers=key, timeout=60,
                          json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == exp.outputs[0].text


# ---- one request never hurts another -----------------------------------------------------------

LONG_BODY = {"prompt": "Tokens are generated one at a time", "max_tokens": 150, "temperature": 0,
             "ignore_eos": True, "stream": True}


def _stream_times(url: str, body: dict) -> tuple[str, list[float]]:
    """A streamed completion's text and the arrival time of each of its chunks."""
    text, times = [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.monotonic())
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text), times


class _LongStreams:
    """Streams LONG_BODY again and again in a thread, keeping every run's text."""

    def __init__(self, url: str) -> None:
        import threading

        self.url, self.texts, self.times = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            text, times = _stream_times(self.url, LONG_BODY)
            self.texts.append(text)
            self.times += times

    def __enter__(self) -> _LongStreams:
        self._thread.start()
        wait_until(lambda: len(self.times) > 3, 60, "the long stream started")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


def test_fuzzed_requests_never_hurt_a_long_stream(url, offline):
    """Random extreme values in every field of both endpoints (the strategies of
    test_fuzz_requests.py), 8 at a time, while a long request streams: every bad request gets a
    400 (404 for ``model``) naming a field it set, and the long request finishes intact."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from engine import SamplingParams

    from .test_fuzz_requests import BASE, bodies

    (expected,) = offline.generate([LONG_BODY["prompt"]], SamplingParams(
        temperature=0, max_tokens=150, ignore_eos=True), use_tqdm=False)
    paths = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}

    async def send(items):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post(
                paths[ep], content=json.dumps({**BASE[ep], **f}),
                headers={"content-type": "application/json"}) for ep, f in items))

    @settings(max_examples=12, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(items=st.lists(st.sampled_from(["completions", "chat"]).flatmap(
        lambda ep: st.tuples(st.just(ep), bodies(ep))), min_size=1, max_size=8))
    def check(items):
        for (_, fields), resp in zip(items, asyncio.run(send(items)), strict=True):
            assert resp.status_code in (200, 400, 404), (fields, resp.text)
            if resp.status_code != 200:
                param = _error(resp, resp.status_code)["param"]
                assert param and param.split(".")[0] in {*fields, "max_tokens"}, (fields, param)

    with _LongStreams(url) as streams:
        check()
    assert streams.texts and set(streams.texts) == {expected.outputs[0].text}


def test_a_huge_prompt_does_not_stall_other_streams(url):
    """A 4 MiB prompt is tokenized off the Router's event loop: a stream on the same Router
    keeps receiving tokens while it is (before, the loop stood still for the whole encode)."""
    huge = {"prompt": "tokenization takes time " * 170_000, "max_tokens": 1}
    with _LongStreams(url) as streams:
        start = time.monotonic()
        resp = httpx.post(f"{url}/v1/completions", json=huge, timeout=120)
        end = time.monotonic()
    assert _error(resp, 400)["code"] == "context_length_exceeded"
    during = [t for t in streams.times if start + 0.2 < t < end]
    assert end - start > 1.0  # long enough for the count below to mean something
    assert len(during) >= 10, (end - start, len(during))


# ---- structured output and tools through the official client ----------------------------------

class Answer(pydantic.BaseModel):
    ok: bool
    digit: int = pydantic.Field(ge=0, le=9)
    color: Literal["red", "green"]


# short: this tokenizer spends a token on nearly every JSON character of the tool in the prompt
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}}}


def test_structured_output_through_the_client(url, model_path):
    client = _client(url)
    done = client.chat.completions.parse(
        model=model_path, messages=[{"role": "user", "content": "Answer"}],
        response_format=Answer, max_completion_tokens=60, temperature=0)
    assert isinstance(done.choices[0].message.parsed, Answer)
    assert done.choices[0].finish_reason == "stop"
    text = client.completions.create(model=model_path, prompt="Code:", max_tokens=12,
                                     temperature=1.0, seed=3,
                                     extra_body={"structured_outputs": {"regex": r"[0-9]{3}"}})
    assert re.fullmatch(r"[0-9]{3}", text.choices[0].text)
    schema = {"type": "json_schema", "json_schema": {"name": "a",
                                                     "schema": Answer.model_json_schema()}}
    obj = client.completions.create(model=model_path, prompt="JSON:", max_tokens=40,
                                    temperature=0, extra_body={"response_format": schema})
    Answer.model_validate_json(obj.choices[0].text)
    bad = httpx.post(f"{url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "a", "schema": {"type": "object", "properties": {"a": {"type": 7}}}}}})
    assert _error(bad, 400)["param"] == "response_format.json_schema.schema"


def test_tool_calls_through_the_client(url, model_path):
    client = _client(url)
    messages = [{"role": "user", "content": "Pick"}]
    calls = []
    for choice in ("required", {"type": "function", "function": {"name": "pick"}}):
        resp = client.chat.completions.create(model=model_path, messages=messages,
                                              tools=[TOOL], tool_choice=choice,
                                              parallel_tool_calls=False,
                                              max_completion_tokens=40, temperature=0)
        [call] = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "pick" and call.id.startswith("call_")
        assert json.loads(call.function.arguments)["n"] in (1, 2, 3)
        calls.append(call)
    with client.chat.completions.stream(model=model_path, messages=messages, tools=[TOOL],
                                        tool_choice="required", parallel_tool_calls=False,
                                        max_completion_tokens=40, temperature=0) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert streamed.function.name == "pick" and final.choices[0].finish_reason == "tool_calls"
    assert streamed.function.arguments == calls[0].function.arguments  # the same greedy call
    answered = client.chat.completions.create(
        model=model_path, tools=[TOOL], tool_choice="none", max_completion_tokens=5,
        messages=[*messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "pick",
                                                             "arguments": '{"n": 2}'}}]},
                  {"role": "tool", "tool_call_id": call.id, "content": "picked 2"}])
    assert answered.choices[0].message.tool_calls is None
    auto = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages,
                                                          "tools": [TOOL]})
    assert "tool_call_parser" in _error(auto, 400)["message"]


# ---- vLLM's small endpoints, system_fingerprint and stop_reason ---------------------------------

def test_tokenize_detokenize_version_and_model_by_id(url, model_path, offline):
    from importlib import metadata

    tok = offline.get_tokenizer()
    text = "Hello, my name is"
    ids = tok(text).input_ids
    assert httpx.post(f"{url}/tokenize", json={"model": model_path, "prompt": text}).json() == \
        {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    bare = tok(text, add_special_tokens=False).input_ids
    assert bare != ids  # the tokenizer adds BOS
    assert httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False,
                                               "return_token_strs": True}).json() == \
        {"count": len(bare), "max_model_len": MAX_MODEL_LEN, "tokens": bare,
         "token_strs": tok.convert_ids_to_tokens(bare)}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
    resp = httpx.post(f"{url}/tokenize", json={"messages": messages})
    assert resp.json()["tokens"] == chat_ids
    chat = _client(url).chat.completions.create(model=None, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == len(chat_ids)  # the ids a chat request sends
    # errors: the same 404 as the other endpoints; 400s naming the field
    wrong = httpx.post(f"{url}/tokenize", json={"model": "gpt-17", "prompt": "x"})
    assert _error(wrong, 404) == _error(httpx.post(f"{url}/v1/completions", json={
        "model": "gpt-17", "prompt": "x"}), 404)
    assert _error(wrong, 404)["code"] == "model_not_found"
    both = httpx.post(f"{url}/tokenize", json={"prompt": "x", "messages": messages})
    assert _error(both, 400)["param"] == "prompt"
    assert _error(httpx.post(f"{url}/tokenize", json={"prompt": 5}), 400)["param"] == "prompt"
    assert httpx.post(f"{url}/detokenize", json={"model": model_path, "tokens": ids}).json() == \
        {"prompt": tok.decode(ids)}
    vocab = offline.engine.vocab_size
    outside = httpx.post(f"{url}/detokenize", json={"tokens": [5, 10**6]})
    assert _error(outside, 400) == {
        "message": f"tokens: token id 1000000 is outside the vocabulary [0, {vocab})",
        "type": "invalid_request_error", "param": "tokens", "code": None}
    assert _error(httpx.post(f"{url}/detokenize", json={"tokens": [-1]}), 400)["param"] == \
        "tokens.0"
    assert httpx.get(f"{url}/version").json() == {"version": metadata.version("pagedserve")}
    # one model by id: the list's object; another id is OpenAI's 404
    client = _client(url)
    assert client.models.retrieve(model_path) == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-17")
    assert missing.value.body["code"] == "model_not_found"
    assert _error(httpx.get(f"{url}/v1/models/gpt-17"), 404) == _error(wrong, 404)
    # the API key guards them as every route but /health
    for method, path in (("GET", "/version"), ("GET", f"/v1/models/{model_path}"),
                         ("POST", "/tokenize"), ("POST", "/detokenize")):
        resp = httpx.request(method, f"{url}/guarded{path}", json={"prompt": "x"})
        assert _error(resp, 401)["code"] == "invalid_api_key", path


def test_system_fingerprint_and_stop_reason(url, model_path, offline):
    from engine import SamplingParams
    from serve_app.router.endpoints import _fingerprint, pagedserve_version

    fingerprint = _fingerprint(pagedserve_version(), model_path, "float32", None, "float32")
    client = _client(url)
    tok = offline.get_tokenizer()
    messages = [{"role": "user", "content": "Say something"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = offline.generate([ids], greedy, use_tqdm=False)
    text = full.outputs[0].text
    start = next(i for i in range(2, len(text) - 3)
                 if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[start:start + 3]
    resp = client.chat.completions.create(model=None, messages=messages, max_tokens=24,
                                          temperature=0, stop=[stop],
                                          extra_body={"ignore_eos": True})
    assert resp.system_fingerprint == fingerprint
    choice = resp.choices[0]
    assert (choice.message.content, choice.finish_reason, choice.model_extra["stop_reason"]) == \
        (text[:start], "stop", stop)
    # a stop token id: the id, as the offline engine reports it
    stop_id = full.outputs[0].token_ids[4]  # it stops at its first occurrence
    (want,) = offline.generate([ids], SamplingParams(temperature=0, max_tokens=24,
                                                     ignore_eos=True, stop_token_ids=[stop_id]),
                               use_tqdm=False)
    assert want.outputs[0].stop_reason == stop_id
    chunks = list(client.chat.completions.create(
        model=None, messages=messages, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}))
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert [(c.choices[0].finish_reason, c.choices[0].model_extra["stop_reason"])
            for c in chunks][-1] == ("stop", stop_id)
    assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-1])
    # completions: the length limit is no stop_reason; the same fingerprint
    done = client.completions.create(model=None, prompt="Hello", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.system_fingerprint == fingerprint
    assert (done.choices[0].finish_reason, done.choices[0].model_extra["stop_reason"]) == \
        ("length", None)
    (hello,) = offline.generate(["Hello"], greedy, use_tqdm=False)
    hello_stop = hello.outputs[0].token_ids[3]
    streamed = list(client.completions.create(model=None, prompt="Hello", max_tokens=24,
                                              temperature=0, stream=True,
                                              extra_body={"stop_token_ids": [hello_stop],
                                                          "ignore_eos": True}))
    assert {c.system_fingerprint for c in streamed} == {fingerprint}
    assert (streamed[-1].choices[0].finish_reason,
            streamed[-1].choices[0].model_extra["stop_reason"]) == ("stop", hello_stop)
    # another deployment configuration (int8 weights, fp8 KV cache): another fingerprint
    guarded = _client(url, "/guarded", API_KEY).completions.create(model=None, prompt="Hi",
                                                                   max_tokens=1)
    assert guarded.system_fingerprint == _fingerprint(pagedserve_version(), model_path,
                                                      "float32", "int8", "fp8_e4m3")
    assert guarded.system_fingerprint != fingerprint


def test_chat_template_options_reach_the_template(url, offline):
    """continue_final_message and chat_template_kwargs through HTTP: the prompt the template
    renders, continued as the offline engine continues it; their 400s."""
    from engine import SamplingParams

    tok = offline.get_tokenizer()
    messages = [{"role": "user", "content": "Name a city."},
                {"role": "assistant", "content": "Paris is"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True),
              add_special_tokens=False).input_ids
    assert ids[-2:] == tok("Paris is", add_special_tokens=False).input_ids[-2:]  # no end of turn
    (exp,) = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    resp = _client(url).chat.completions.create(
        model=None, messages=messages, max_tokens=8, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True,
                    "chat_template_kwargs": {"enable_thinking": False}, "ignore_eos": True})
    assert resp.choices[0].message.content == exp.outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)
    both = httpx.post(f"{url}/v1/chat/completions",
                      json={"messages": messages, "continue_final_message": True})
    assert _error(both, 400)["param"] == "continue_final_message"
    reserved = httpx.post(f"{url}/v1/chat/completions",
                          json={"messages": messages, "chat_template_kwargs": {"tokenize": True}})
    err = _error(reserved, 400)
    assert (err["param"], err["message"].split(" (got ")[0]) == (
        "chat_template_kwargs", "chat_template_kwargs: must not set tokenize (set through the "
        "request's own fields or by the server)")
