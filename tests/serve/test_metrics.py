"""Metrics end to end: the real app on one local Ray cluster, a known workload, then

* Ray's metrics export (an explicit port on 127.0.0.1) scraped directly: every series agrees
  with what was sent (requests, tokens, histogram counts) or with the engine's own counters;
* a real Prometheus server (Debian's ``prometheus``) scraping it every second: a PromQL request
  count through its HTTP API;
* every PromQL expression of the Grafana dashboard evaluated by that Prometheus (its parser),
  returning data, and naming only series the app or Ray Serve exports;
* ``deploy/grafana/README.md`` listing every exported ``ray_pagedserve_*`` series.

The Worker deployment runs under an autoscaling policy pinned to one replica, so Serve exports
its autoscaling series too. The KV cache holds 10 blocks, so the first batch is preempted.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from deploy.grafana.dashboard import expressions
from serve_app import build_app

from .cluster import ROOT, free_port, local_ray, make_tiny_checkpoint, wait_until

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 128
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block_size * kv heads * head dim * fp32
PROMETHEUS_INSTALL = ("apt-get update && apt-get install -y --no-install-recommends prometheus "
                      "(Debian's package; the test starts its own server)")
BATCH_PROMPTS = ["Hello, my name is", "The quick brown fox", "Paris is the capital of",
                 "Tokens are generated one at a time"]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3
P = "ray_pagedserve_"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def cluster(model_path):
    """(Serve URL, metrics-export port) with the app running."""
    metrics_port = free_port()
    app = build_app({
        "model": model_path, "dtype": "float32", "max_model_len": MAX_MODEL_LEN,
        "block_size": 16, "kv_cache_memory_bytes": 10 * BLOCK_BYTES, "num_threads": 1,
        "accelerator": "cpu", "router_num_cpus": 0.5, "routing_stats_period_s": 0.5,
        "max_batch_size": 8, "batch_wait_ms": 5, "max_waiting_requests": 4,
        "autoscaling": {"min_replicas": 1, "max_replicas": 1, "metrics_interval_s": 1.0,
                        "look_back_period_s": 5.0},
    })
    with local_ray(num_cpus=4, _metrics_export_port=metrics_port,
                   _system_config={"metrics_report_interval_ms": 1000}) as base:
        serve.run(app, name="metrics", route_prefix="/", blocking=False)
        wait_until(lambda: serve.status().applications["metrics"].status == "RUNNING", 180,
                   "app running")
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 60, "app healthy")
        yield base, metrics_port


@pytest.fixture(scope="module", autouse=True)
def prometheus_binary():
    """Debian's Prometheus server: checked first, so a machine without it fails at once."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail(f"the `prometheus` binary is not installed; install it with: "
                    f"{PROMETHEUS_INSTALL}", pytrace=False)
    return binary


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, cluster, tmp_path_factory):
    """A Prometheus server scraping Ray's metrics export every second: its base URL."""
    binary = prometheus_binary
    _, metrics_port = cluster
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    job = config["scrape_configs"][0]
    assert job["job_name"] == "ray"
    del job["file_sd_configs"]  # no Ray dashboard here, so no service-discovery file
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(lambda: httpx.get(f"{url}/-/ready").status_code == 200, 30,
                       "prometheus ready")
        except TimeoutError:
            log.flush()
            pytest.fail(f"prometheus did not start; its log ends with:\n"
                        f"{(tmp / 'prometheus.log').read_text()[-2000:]}", pytrace=False)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def workload(cluster, model_path, prometheus):
    """Send the known requests; return what the metrics must show."""
    base, _ = cluster
    with httpx.Client(base_url=base, timeout=120) as client:
        usages = [_complete(client, model_path, BATCH_PROMPTS, 40)]  # preempted: 12 blocks > 10
        usages += [_complete(client, model_path, LONG_PROMPT, 4) for _ in range(2)]  # prefix hit
        usages.append(_chat_stream(client, model_path, 8))
        statuses, extra = _race_for_429(client, model_path, usages)
        # More prompts than the whole waiting bound (4) can never be admitted: a 400.
        busy = client.post("/v1/completions", json={"model": model_path, "max_tokens": 2,
                                                    "prompt": BATCH_PROMPTS + ["one too many"]})
        assert busy.status_code == 400, busy.text
        too_long = client.post("/v1/completions", json={"model": model_path, "max_tokens": 2,
                                                        "prompt": list(range(1, 200))})
        assert too_long.status_code == 400, too_long.text
        stats = client.get("/v1/stats").json()
    num_requests = len(BATCH_PROMPTS) + 3 + extra
    generated = sum(u["completion_tokens"] for u in usages)
    return {"num_requests": num_requests, "prompt": sum(u["prompt_tokens"] for u in usages),
            "generated": generated, "itl": generated - num_requests, "stats": stats,
            "statuses": statuses}


def _race_for_429(client, model_path, usages, tries=20):
    """Four prompts and one more sent together: while the four wait for their first tokens the
    waiting bound (4) is full, so one of the two is refused with 429. Returns the status counts
    and how many prompts the accepted ones carried (their usage is appended)."""
    from concurrent.futures import ThreadPoolExecutor

    statuses = {"200": 0, "429": 0}
    extra = 0
    bodies = [(BATCH_PROMPTS, len(BATCH_PROMPTS)), ("one more", 1)]
    for _ in range(tries):
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(client.post, "/v1/completions",
                                   json={"model": model_path, "max_tokens": 2, "prompt": p,
                                         "ignore_eos": True})
                       for p, _ in bodies]
            responses = [f.result() for f in futures]
        for resp, (_, n) in zip(responses, bodies):
            assert resp.status_code in (200, 429), resp.text
            statuses[str(resp.status_code)] += 1
            if resp.status_code == 200:
                usages.append(resp.json()["usage"])
                extra += n
        if statuses["429"]:
            return statuses, extra
    raise AssertionError(f"no 429 in {tries} tries")


def _complete(client: httpx.Client, model: str, prompt, max_tokens: int) -> dict:
    resp = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                "max_tokens": max_tokens, "temperature": 0,
                                                "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def _chat_stream(client: httpx.Client, model: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


# ---- scraping Ray's metrics export ---------------------------------------------------------------

def scrape(port: int) -> list:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def expected_series(work: dict, model: str) -> dict[tuple, float]:
    n, stats = work["num_requests"], work["stats"]
    engine, router = stats["total"], stats["router"]
    batches = sum(router["batch_sizes"].values())
    c, h = "/v1/completions", "/v1/chat/completions"
    return {
        ("request_success_total", "length"): n,
        ("time_to_first_token_seconds_count",): n,
        ("e2e_request_latency_seconds_count",): n,
        ("request_queue_time_seconds_count",): n,
        ("inter_token_latency_seconds_count",): work["itl"],
        ("prompt_tokens_total",): work["prompt"],
        ("generation_tokens_total",): work["generated"],
        ("prefix_cache_queries_total",): engine["prefix_cache_queries"],
        ("prefix_cache_hits_total",): engine["prefix_cache_hits"],
        ("num_preemptions_total",): engine["num_preemptions"],
        ("num_requests_running",): 0,
        ("num_requests_waiting",): 0,
        ("kv_cache_usage_perc",): engine["kv_cache_usage"],
        ("router_batch_size_count",): batches,
        ("router_requests_rejected_total", "queue_full"): work["statuses"]["429"],
        ("http_requests_total", c, "200"): 3 + work["statuses"]["200"],
        ("http_requests_total", c, "429"): work["statuses"]["429"],
        ("http_requests_total", c, "400"): 2,
        ("http_requests_total", h, "200"): 1,
    }


def observed_series(samples: list, keys, model: str) -> dict[tuple, float]:
    out = {}
    for key in keys:
        name, *labels = key
        extra = {}
        if name == "request_success_total":
            extra = {"finished_reason": labels[0]}
        elif name == "router_requests_rejected_total":
            extra = {"cause": labels[0]}
        elif name == "http_requests_total":
            extra = {"handler": labels[0], "status": labels[1]}
        out[key] = total(samples, P + name, model_name=model, **extra)
    return out


def test_scrape_agrees_with_the_workload(cluster, workload, model_path):
    _, port = cluster
    work = workload
    assert work["stats"]["total"]["num_preemptions"] > 0
    assert work["stats"]["total"]["prefix_cache_hits"] > 0
    expected = expected_series(work, model_path)
    observed: dict = {}

    def agree():
        nonlocal observed
        observed = observed_series(scrape(port), expected, model_path)
        return observed == expected

    try:
        wait_until(agree, 30, "exported metrics agree with the workload", interval_s=1.0)
    except TimeoutError:
        diff = {k: (observed.get(k), v) for k, v in expected.items() if observed.get(k) != v}
        pytest.fail(f"(observed, expected) differ for {diff}")
    samples = scrape(port)
    steps = total(samples, P + "iteration_tokens_total_count", model_name=model_path)
    assert steps == total(samples, P + "iteration_duration_seconds_count", model_name=model_path)
    assert steps > 0
    replicas = {s.labels["replica"] for s in samples if s.name == P + "num_requests_running"}
    assert len(replicas) == 1 and replicas != {""}
    info = [(s.labels["dtype"], s.labels["quantization"], s.labels["kv_cache_dtype"],
             s.labels["replica"], s.value)
            for s in samples if s.name == P + "model_info" and s.labels["model_name"] == model_path]
    assert info == [("float32", "none", "float32", *replicas, 1.0)]
    # Ray estimates a histogram's _sum from bucket midpoints; its buckets are exact
    sizes = {int(k): v for k, v in work["stats"]["router"]["batch_sizes"].items()}
    assert sum(k * v for k, v in sizes.items()) == work["num_requests"]
    buckets: dict[float, float] = {}
    for s in samples:
        if s.name == P + "router_batch_size_bucket" and s.labels["model_name"] == model_path:
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    assert buckets and buckets == {le: sum(v for k, v in sizes.items() if k <= le)
                                   for le in buckets}


def test_prometheus_counts_the_requests(prometheus, workload, model_path):
    query = f'sum(ray_pagedserve_request_success_total{{model_name="{model_path}"}})'
    wait_until(lambda: _prom_value(prometheus, query) == workload["num_requests"], 30,
               f"Prometheus: {query} == {workload['num_requests']}", interval_s=1.0)
    ttft = f'sum(ray_pagedserve_time_to_first_token_seconds_count{{model_name="{model_path}"}})'
    assert _prom_value(prometheus, ttft) == workload["num_requests"]


def _prom_query(url: str, query: str) -> dict:
    resp = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=10)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (query, body)
    return body["data"]


def _prom_value(url: str, query: str) -> float | None:
    result = _prom_query(url, query)["result"]
    return float(result[0]["value"][1]) if result else None


# ---- the dashboard's queries ---------------------------------------------------------------------

def _concrete(expr: str) -> str:
    """A dashboard expression as Grafana sends it with every variable at "All"."""
    expr = expr.replace("$__rate_interval", "1m")
    for var in ("model_name", "replica", "application"):
        expr = expr.replace(f"${var}", ".*")
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", expr)
    return f"count by ({match[2]}) ({match[1]})" if match else expr


def test_dashboard_queries_parse_and_name_exported_series(cluster, prometheus, workload):
    _, port = cluster
    wanted = [(expr, set(re.findall(r"\bray_\w+", expr))) for expr in expressions()]
    assert all(names for _, names in wanted)
    missing: list = []

    def all_exported():  # Ray's exporter can serve a scrape between two flushes: look again
        exported = {s.name for s in scrape(port)}
        missing[:] = [(expr, names - exported) for expr, names in wanted if names - exported]
        return not missing

    try:
        wait_until(all_exported, 30, "every dashboard series exported", interval_s=2.0)
    except TimeoutError:
        pytest.fail(f"dashboard series not exported: {missing}")
    empty: list[str] = []

    def all_have_data():
        empty[:] = [e for e in expressions() if not _prom_query(prometheus, _concrete(e))["result"]]
        return not empty

    try:
        wait_until(all_have_data, 30, "every dashboard query has data", interval_s=2.0)
    except TimeoutError:
        pytest.fail(f"dashboard queries without data: {empty}")


def test_readme_lists_every_exported_series(cluster, workload):
    _, port = cluster
    families = {re.sub(r"_(bucket|count|sum)$", "", s.name) for s in scrape(port)
                if s.name.startswith(P)}
    readme = (Path(ROOT) / "deploy/grafana/README.md").read_text()
    assert families == set(re.findall(rf"`({P}\w+)`", readme)) - {P}
