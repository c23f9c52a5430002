"""``serve_app.metrics.worker`` without Ray: what each hook records, with stand-ins for Ray's metric
classes (the end-to-end export is ``test_metrics.py``)."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.outputs import CompletionOutput, RequestOutput
from serve_app.metrics import common
from serve_app.metrics import names as metric_names
from serve_app.metrics import router as router_metrics
from serve_app.metrics import worker as metrics
from serve_app.metrics.names import Naming


class _Recorder:
    def __init__(self, name, description="", tag_keys=(), boundaries=None):
        self.name, self.tag_keys, self.boundaries = name, tag_keys, boundaries
        self.default_tags: dict = {}
        self.calls: list[tuple[float, dict]] = []

    def set_default_tags(self, tags):
        self.default_tags = tags
        return self

    def _add(self, value, tags=None):
        full = {**self.default_tags, **(tags or {})}
        assert set(full) == set(self.tag_keys), (self.name, full)
        self.calls.append((value, tags or {}))

    inc = set = observe = _add


@pytest.fixture
def recorded(monkeypatch):
    for kind in ("Counter", "Gauge", "Histogram"):
        recorder = type(kind, (_Recorder,), {})
        for module in (metrics, common):
            if hasattr(module, kind):
                monkeypatch.setattr(module, kind, recorder)
    monkeypatch.setattr(common, "_defined", {})
    return common._defined


def values(defined, name):
    """What was recorded into pagedserve's series ``name`` (``vllm_...``: vLLM's spelling)."""
    return [v for v, _ in defined[_full(name)].calls]


def _full(name):
    return name if name.startswith("vllm_") else "pagedserve_" + name


class FakeEngine:
    def __init__(self):
        self.stats = {"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25,
                      "prompt_tokens_total": 10, "generation_tokens_total": 4,
                      "prefix_cache_queries": 10, "prefix_cache_hits": 0, "num_preemptions": 0}
        self.steps = [(0.01, 12), (0.02, 2)]

    def get_stats(self):
        return dict(self.stats)

    def pop_step_records(self):
        steps, self.steps = self.steps, []
        return steps


def _out(finished: bool, reason: str | None = None, **m: float) -> RequestOutput:
    return RequestOutput("r", [1, 2], [CompletionOutput(0, [7], finish_reason=reason)],
                         finished=finished, metrics=m)


def test_flush_sets_gauges_adds_counter_increases_and_step_records(recorded):
    engine = FakeEngine()
    wm = metrics.WorkerMetrics(engine, "m", "rep1")
    wm.flush()
    engine.stats.update(prompt_tokens_total=15, generation_tokens_total=9, num_running=0)
    wm.flush()
    assert values(recorded, "num_requests_running") == [2.0, 0.0]
    assert values(recorded, "kv_cache_usage_perc") == [0.25, 0.25]
    assert values(recorded, "prompt_tokens_total") == [10.0, 5.0]
    assert values(recorded, "generation_tokens_total") == [4.0, 5.0]
    assert values(recorded, "prefix_cache_hits_total") == []  # Ray counters take only > 0
    assert values(recorded, "iteration_duration_seconds") == [0.01, 0.02]
    assert values(recorded, "iteration_tokens_total") == [12, 2]
    assert recorded[_full("num_requests_running")].default_tags == {"model_name": "m", "replica": "rep1"}


def test_track_times_outputs_across_flushes_and_records_the_end(recorded):
    wm = metrics.WorkerMetrics(FakeEngine(), "m", "rep1")

    async def outputs():
        yield _out(False)
        yield _out(False)
        wm.flush()  # a flush while the request is still streaming
        yield _out(True, "length", arrival_time=1.0, first_scheduled_time=1.5,
                   first_token_time=2.0, finished_time=4.0, num_prompt_tokens=3.0,
                   num_generation_tokens=5.0)

    async def consume():
        return [o async for o in wm.track(outputs())]

    assert len(asyncio.run(consume())) == 3
    wm.flush()
    assert len(values(recorded, "inter_token_latency_seconds")) == 2
    assert values(recorded, "engine_time_to_first_token_seconds") == [1.0]
    assert values(recorded, "request_queue_time_seconds") == [0.5]
    assert values(recorded, "e2e_request_latency_seconds") == [3.0]
    assert values(recorded, "request_prefill_time_seconds") == [0.5]
    assert values(recorded, "request_decode_time_seconds") == [2.0]
    assert values(recorded, "request_inference_time_seconds") == [2.5]
    assert values(recorded, "request_time_per_output_token_seconds") == [0.5]  # 2 s / (5 - 1)
    assert values(recorded, "request_prompt_tokens") == [3.0]
    assert values(recorded, "request_generation_tokens") == [5.0]
    assert recorded[_full("request_success_total")].calls == [(1, {"finished_reason": "length"})]


def test_a_cancelled_stream_counts_as_abort(recorded):
    wm = metrics.WorkerMetrics(FakeEngine(), "m", "rep1")

    async def outputs():
        yield _out(False)
        await asyncio.sleep(3600)
        yield _out(True, "stop")

    async def consume():
        task = asyncio.create_task(_drain(wm.track(outputs())))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(consume())
    assert recorded[_full("request_success_total")].calls == [(1, {"finished_reason": "abort"})]
    assert _full("engine_time_to_first_token_seconds") not in {
        n for n, m in recorded.items() if m.calls}


def test_a_stream_cancelled_for_a_stop_string_counts_as_stop(recorded):
    """The Router aborts a request whose text hit a stop string with reason "stop": the
    Worker's task is cancelled with that message, and it is counted as a stop, not an abort."""
    wm = metrics.WorkerMetrics(FakeEngine(), "m", "rep1")

    async def outputs():
        yield _out(False)
        await asyncio.sleep(3600)

    async def consume():
        task = asyncio.create_task(_drain(wm.track(outputs())))
        await asyncio.sleep(0.05)
        task.cancel("stop")
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(consume())
    assert recorded[_full("request_success_total")].calls == [(1, {"finished_reason": "stop"})]


async def _drain(gen):
    async for _ in gen:
        pass


def test_router_batches_rejections_and_http_statuses(recorded):
    rm = router_metrics.RouterMetrics("m", "router1")
    sent = []

    async def send(batch):
        sent.append(batch)

    class Batch:
        requests = [1, 2, 3]

    asyncio.run(rm.count_batches(send)(Batch))
    rm.rejected("queue_full")
    rm.response("/v1/completions", 429)
    rm.first_token(0.25)
    assert sent == [Batch] and values(recorded, "router_batch_size") == [3]
    assert values(recorded, "time_to_first_token_seconds") == [0.25]
    assert recorded[_full("router_requests_rejected_total")].calls == [(1, {"cause": "queue_full"})]
    assert recorded[_full("http_requests_total")].calls == [
        (1, {"handler": "/v1/completions", "status": "429"})]


@pytest.mark.parametrize("path,root,handler", [
    ("/v1/completions", "", "/v1/completions"),
    ("/guarded/v1/chat/completions", "/guarded", "/v1/chat/completions"),
    ("/v1/unknown", "", "other"),
    ("/tokenize", "", "/tokenize"),
    ("/v1/models/org/name", "", "/v1/models/{id}"),
])
def test_handler_label_is_bounded(path, root, handler):
    assert router_metrics._handler({"path": path, "root_path": root}) == handler


def test_http_middleware_counts_into_the_metrics_it_is_given(recorded):
    """The Router hands its replica's metrics to the middleware of the app Serve serves (no
    module global): every response is counted there, by handler and status."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from serve_app.router.router import Router

    rm = router_metrics.RouterMetrics("m", "router1")
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    served = Router.func_or_class.__serve_build_asgi_app__(SimpleNamespace(app=app, metrics=rm))
    assert served is app
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/v1/nothing").status_code == 404
    assert recorded[_full("http_requests_total")].calls == [
        (1, {"handler": "/health", "status": "200"}), (1, {"handler": "other", "status": "404"})]


def test_vllm_naming_uses_vllm_names_and_labels(recorded):
    """``metrics_naming: vllm``: the series vLLM has carry its names as Ray Serve LLM exports
    them (counters without ``_total``: Ray's exporter adds it) and the labels model_name,
    engine and ReplicaId; pagedserve's own series keep their names, with the same labels."""
    naming = Naming("vllm")
    wm = metrics.WorkerMetrics(FakeEngine(), "m", "rep1", naming=naming, info={
        "cache_config_info": {"block_size": "16", "num_gpu_blocks": "64"}})
    wm.flush()
    rm = router_metrics.RouterMetrics("m", "router1", naming)
    rm.first_token(0.5)
    tags = {"model_name": "m", "engine": "0", "ReplicaId": "rep1"}
    assert values(recorded, "vllm_num_requests_running") == [2.0]
    assert recorded["vllm_num_requests_running"].default_tags == tags
    assert values(recorded, "vllm_prompt_tokens") == [10.0]
    assert values(recorded, "vllm_generation_tokens") == [4.0]
    assert values(recorded, "vllm_iteration_tokens_total") == [12, 2]
    assert values(recorded, "vllm_time_to_first_token_seconds") == [0.5]
    assert values(recorded, "iteration_duration_seconds") == [0.01, 0.02]  # pagedserve's own
    assert recorded["pagedserve_iteration_duration_seconds"].default_tags == tags
    assert recorded["vllm_cache_config_info"].calls == [
        (1.0, {**tags, "block_size": "16", "num_gpu_blocks": "64"})]
    assert {n for n in recorded if n.startswith("pagedserve_")} == {
        "pagedserve_iteration_duration_seconds", "pagedserve_engine_time_to_first_token_seconds",
        "pagedserve_router_batch_size", "pagedserve_router_requests_rejected_total",
        "pagedserve_http_requests_total"}


def test_vllm_names_cover_what_rays_llm_dashboard_reads():
    """Every ``ray_vllm_*`` series Ray's own Serve LLM dashboard queries, of those pagedserve
    has a counterpart for, is exported under that name with ``metrics_naming: vllm``."""
    import re
    from pathlib import Path

    import ray

    panels = Path(ray.__file__).parent / "dashboard/modules/metrics/dashboards"
    text = (panels / "serve_llm_dashboard_panels.py").read_text()
    wanted = {re.sub(r"_(bucket|sum|count)$", "", n) for n in re.findall(r"ray_vllm_\w+", text)}
    naming = Naming("vllm")
    ours = {naming.exported(key) for key in metric_names.VLLM_NAMES}
    covered = wanted & ours
    assert {"ray_vllm_generation_tokens_total", "ray_vllm_prompt_tokens_total",
            "ray_vllm_request_success_total", "ray_vllm_num_requests_running",
            "ray_vllm_kv_cache_usage_perc", "ray_vllm_time_to_first_token_seconds",
            "ray_vllm_request_prefill_time_seconds", "ray_vllm_request_decode_time_seconds",
            "ray_vllm_request_prompt_tokens"} <= covered
