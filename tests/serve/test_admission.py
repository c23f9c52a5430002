"""Admission by predicted wait (``serve_app.router.admission``) on a scripted queue and clock: exact
429-or-admit decisions and ``Retry-After`` values; the hard cap beside it; holding while a Worker
starts; and a real Router's HTTP answer (429, ``Retry-After``, OpenAI-style JSON body) when the
scripted Workers' stats predict too long a wait."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from engine.core.sampling_params import SamplingParams
from serve_app.config import AppConfig
from serve_app.router.admission import Admission, QueueView, Rejected, retry_after
from serve_app.router.batch import EngineRequest
from tests.serve.test_hardening import _processor
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)


class Script:
    """The Workers' routing stats and the clock, as a test sets them."""

    def __init__(self) -> None:
        self.stats: list[dict] = []
        self.t = 0.0

    def admission(self, slo_s: float | None, active=(), max_waiting: int = 100,
                  start_s: float = 30.0) -> Admission:
        return Admission(max_waiting, slo_s, start_s, active, routing_stats=lambda: self.stats,
                         clock=lambda: self.t)


def _decide(admission: Admission, num_seqs: int | None = 1) -> int | None:
    """None when admitted, else the 429's Retry-After."""
    try:
        admission.admit(num_seqs, mean_ttft_s=0.0)
    except Rejected as exc:
        assert exc.status == 429 and exc.headers == {"Retry-After": str(exc.retry_after_s)}
        return exc.retry_after_s
    return None


def _unrouted(n: int) -> EngineRequest:
    return EngineRequest([1, 2], SamplingParams(n=n))


@pytest.mark.parametrize("stats, own, decision", [
    ([], 0, None),  # nothing ahead
    ([{"num_waiting": 8, "finished_per_s": 4.0}], 0, None),  # 2.0 s: exactly the SLO
    ([{"num_waiting": 9, "finished_per_s": 4.0}], 0, 1),  # 2.25 s: ceil(0.25) = 1
    ([{"num_waiting": 30, "finished_per_s": 4.0}], 2, 6),  # (30 + 2 own) / 4 = 8 s: ceil(6) = 6
    ([{"num_waiting": 10, "finished_per_s": 1.5}, {"num_waiting": 5, "finished_per_s": 1.0}],
     0, 4),  # summed over Workers: 15 / 2.5 = 6 s
    ([{"num_waiting": 50, "finished_per_s": 0.0}], 0, None),  # no drain measured: no evidence
    ([{}], 3, None),  # a Worker that has not reported yet
])
def test_a_predicted_wait_over_the_slo_is_a_429_with_the_time_until_it_meets_it(
        stats, own, decision):
    script = Script()
    script.stats = stats
    active = [_unrouted(own)] if own else []
    assert _decide(script.admission(2.0, active)) == decision
    assert _decide(script.admission(None, active)) is None  # off: only the hard cap


def test_the_prediction_counts_what_waits_at_this_router_and_the_workers():
    routed = _unrouted(5)
    routed.replica = "w1"  # at a Worker: its queue is in the Worker's num_waiting
    view = QueueView.of(3, [{"num_waiting": 7, "finished_per_s": 2.0}])
    assert (view, view.wait_s()) == (QueueView(3, 7, 2.0), 5.0)
    script = Script()
    script.stats = [{"num_waiting": 7, "finished_per_s": 2.0}]
    assert script.admission(2.0, [_unrouted(3), routed]).view() == view
    assert retry_after(5.0, 2.0) == 3 and retry_after(2.01, 2.0) == 1 and retry_after(9, 2) == 7


def test_the_message_says_the_predicted_wait():
    script = Script()
    script.stats = [{"num_waiting": 30, "finished_per_s": 4.0}]
    with pytest.raises(Rejected) as err:
        script.admission(2.5).admit(1, 0.0)
    assert (err.value.cause, err.value.message) == (
        "predicted_wait", "the predicted wait for a first token is 7.5s, over this server's "
        "TTFT objective of 2.5s; retry after 5s")


def test_the_hard_cap_holds_with_the_slo():
    script = Script()
    waiting = [_unrouted(4)]  # 4 sequences without a first token
    admission = script.admission(2.0, waiting, max_waiting=6)
    assert _decide(admission, 2) is None
    with pytest.raises(Rejected) as err:
        admission.admit(3, mean_ttft_s=2.2)
    assert (err.value.cause, err.value.headers) == ("queue_full", {"Retry-After": "3"})


def test_while_a_worker_starts_requests_are_held_if_the_start_meets_the_slo():
    script = Script()
    admission = script.admission(10.0, start_s=30.0)
    script.t = 1000.0
    assert _decide(admission, None) == 20  # the first to find no Worker: 30 s to go
    script.t = 1015.0
    assert _decide(admission, None) == 5  # 15 s to go
    script.t = 1020.5
    assert _decide(admission, None) is None  # 9.5 s to go: held
    script.t = 1040.0
    assert _decide(admission, None) is None  # past the expected start: still held
    assert _decide(admission, 1) is None  # a Worker runs: the next start counts afresh
    script.t = 2000.0
    assert _decide(admission, None) == 20
    assert _decide(script.admission(None), None) is None  # off: always held


class _Handle:
    """A Worker deployment that never answers (the request must not get that far)."""

    def options(self, **_):
        return self

    def __getattr__(self, name):
        return SimpleNamespace(remote=lambda **_: asyncio.sleep(3600))


def _post_to_router(monkeypatch, config: AppConfig, routing_stats: list[dict],
                    replicas: list[str]) -> httpx.Response:
    """One completion request to a real Router (no cluster: its Worker handle never answers)."""
    from ray import serve

    from serve_app.router import router as router_module

    # the Router class as written (Serve's ingress wraps it): its routes take any instance
    user_cls = next(c for c in router_module.Router.func_or_class.__mro__ if "_run" in c.__dict__)
    replica = SimpleNamespace(replica_id=SimpleNamespace(unique_id="router-1"))
    monkeypatch.setattr(serve, "get_replica_context", lambda: replica)

    async def main() -> httpx.Response:
        router = object.__new__(user_cls)
        user_cls.__init__(router, _Handle(), config)
        replica.servable_object = router  # what Serve's routes take as ``self``
        router.prompts = _processor()
        router.workers.replicas = lambda: replicas
        router.admission._routing_stats = lambda: routing_stats
        transport = httpx.ASGITransport(app=router_module.api)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.post("/v1/completions",
                                     json={"model": "m", "prompt": "a b c", "max_tokens": 4},
                                     timeout=30)

    return asyncio.run(main())


@pytest.mark.usefixtures("recorded")
def test_a_router_answers_429_with_retry_after_and_an_openai_error(monkeypatch):
    response = _post_to_router(monkeypatch, AppConfig(ttft_slo_s=2.0),
                               [{"num_waiting": 30, "finished_per_s": 4.0}], ["w1"])
    assert response.status_code == 429
    assert response.headers["retry-after"] == "6"  # 30 / 4 = 7.5 s predicted, SLO 2 s
    assert response.json() == {"error": {
        "message": "the predicted wait for a first token is 7.5s, over this server's TTFT "
                   "objective of 2s; retry after 6s",
        "type": "rate_limit_error", "param": None, "code": None}}


@pytest.mark.usefixtures("recorded")
def test_a_router_scaled_to_zero_sheds_rather_than_hold_past_the_slo(monkeypatch):
    config = AppConfig(ttft_slo_s=10.0, autoscaling={"min_replicas": 0, "replica_start_s": 30},
                       cold_start_timeout_s=1.0)  # held, it would get a 503 after 1 s
    response = _post_to_router(monkeypatch, config, [], [])
    assert response.status_code == 429
    assert response.headers["retry-after"] == "20"  # a 30 s start to go, SLO 10 s
    assert response.json()["error"]["message"] == (
        "the predicted wait for a first token is 30.0s, over this server's TTFT objective of "
        "10s; retry after 20s")
