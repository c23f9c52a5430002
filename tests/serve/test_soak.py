"""A short soak (``python -m load_tests.soak``) on one local Ray cluster: about a minute of mixed
traffic at concurrency 4 with every kind of bad request, bursts over the admission bound, one
Worker replica and then one Router replica killed mid-run, dropped streams that must be aborted
at their Workers, then two fault-free passes for the memory check. Every invariant the soak
checks must hold.

The checker itself is tested first, on made-up answers: it must catch each broken promise.
"""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from load_tests.soak import run as soak
from load_tests.soak.mix import Mix
from load_tests.soak.report import Fault, Outcome, _judge_outcome, table
from load_tests.soak.spec import Limits, References, Verdict
from load_tests.soak.verify import verify

pytestmark = pytest.mark.timeout(600)

INVARIANTS = {"no_hung", "belongs", "errors_openai_shape", "bad_input_4xx", "overload_429",
              "no_unexpected_failures", "worker_kill", "router_kill", "disconnect_aborts",
              "kv_free_queues_empty", "memory_stable", "api_key_not_logged"}


# ---- the checker catches broken promises -------------------------------------------------------

def _answer(spec, texts, prompt_tokens=7, rid=None, finish="length"):
    choices = [{"index": k, "text": t, "finish_reason": finish} for k, t in enumerate(texts)]
    return json.dumps({"id": f"cmpl-{rid or spec.request_id}", "choices": choices, "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": spec.max_tokens * len(texts)}})


def _problems(spec, status, payload, refs, headers=None, done=True):
    verdict = verify(spec, status, headers or {}, payload, refs, done)
    return verdict.category, sorted({inv for inv, _ in verdict.problems})


def test_checker_catches_each_broken_promise():
    mix, refs = Mix(Limits(model="m", max_model_len=256, api_key="k")), References()
    spec = mix.valid("completion")
    assert _problems(spec, 200, _answer(spec, ["abc"]), refs) == ("completed", [])
    assert _problems(spec, 200, _answer(spec, ["abc"]), refs) == ("completed", [])
    other = mix.valid("completion")
    other.keys = spec.keys  # same prompt, different request
    assert _problems(other, 200, _answer(other, ["xyz"]), refs) == ("failed", ["belongs"])
    assert _problems(other, 200, _answer(other, ["abc"], rid="soak-999"), refs)[1] == ["belongs"]
    assert _problems(other, 200, _answer(other, ["abc"], prompt_tokens=8), refs)[1] == ["belongs"]
    assert _problems(other, 200, _answer(other, ["abc", "abc"]), refs)[1] == ["belongs"]
    assert _problems(other, 200, _answer(other, ["abc"], finish="stop"), refs)[1] == ["belongs"]

    shaped = json.dumps({"error": {"message": "busy", "type": "rate_limit_error", "param": None,
                                   "code": None}})
    assert _problems(spec, 429, shaped, refs, {"retry-after": "2"}) == ("rejected", [])
    assert _problems(spec, 429, shaped, refs) == ("rejected", ["overload_429"])
    assert _problems(spec, 500, "Internal Server Error", refs) == ("failed",
                                                                   ["errors_openai_shape"])
    bad = mix.bad(next(c for c in mix.bad_cases if c.name == "n_zero"))
    assert _problems(bad, 400, shaped, refs) == ("rejected", [])
    assert _problems(bad, 500, shaped, refs) == ("failed", ["bad_input_4xx"])
    assert _problems(bad, 422, '{"detail": []}', refs) == ("failed", ["bad_input_4xx",
                                                                       "errors_openai_shape"])


def test_checker_reads_streams():
    mix, refs = Mix(Limits(model="m", max_model_len=256)), References()
    spec = mix.valid("completion_stream")

    def chunk(text, finish=None, usage=None):
        body = {"id": f"cmpl-{spec.request_id}",
                "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]}
        if usage:
            body["usage"] = usage
        return json.dumps(body)

    usage = {"prompt_tokens": 5, "completion_tokens": spec.max_tokens}
    events = [chunk("ab"), chunk("c", "length"), chunk("", usage=usage), "[DONE]"]
    assert _problems(spec, 200, events, refs) == ("completed", [])
    assert _problems(spec, 200, events + ["[DONE]"], refs)[1] == ["belongs"]
    late = [chunk("ab"), chunk("c", "length"), chunk("d"), chunk("", usage=usage), "[DONE]"]
    assert _problems(spec, 200, late, refs)[1] == ["belongs"]
    assert _problems(spec, 200, events[:2], refs, done=False) == ("failed", [])
    error = json.dumps({"error": {"message": "Worker unavailable", "type": "x", "param": None,
                                  "code": None}})
    verdict = verify(spec, 200, {}, [chunk("ab"), error, "[DONE]"], refs)
    assert (verdict.category, verdict.detail, verdict.error_shaped) == ("failed",
                                                                         "stream_error", True)


def test_a_failure_belongs_to_the_fault_it_failed_in():
    """Faults come back to back (the next starts once the last has recovered): a request that
    started while a Worker kill recovered and was cut by the Router kill that followed is the
    Router kill's, whose requests may end however the proxy ends them; cut in the Worker
    kill's window alone, it breaks the Worker kill's promise of an OpenAI-shaped error."""
    mix = Mix(Limits(model="m", max_model_len=256))
    worker, router = Fault("worker_kill", 10.0, 30.0), Fault("router_kill", 30.0, 45.0)
    cut = Verdict("failed", [], error_shaped=False, detail="transport:ServerDisconnectedError")

    def problems(start: float, end: float) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {"worker_kill": [], "router_kill": [],
                                       "no_unexpected_failures": []}
        _judge_outcome(Outcome(mix.valid("completion"), 0, cut, start, end), [worker, router],
                       found)
        return {k: v for k, v in found.items() if v}

    assert problems(28.0, 31.0) == {}
    assert router.detail["in_flight_errors"] == {
        "transport:ServerDisconnectedError (not OpenAI-shaped)": 1}
    assert problems(20.0, 25.0) == {
        "worker_kill": ["completion: unclear error transport:ServerDisconnectedError"]}
    assert list(problems(50.0, 51.0)) == ["no_unexpected_failures"]


# ---- the soak ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def args():
    return soak.parse_args(["--duration", "50", "--concurrency", "4",
                            "--faults", "worker_kill,router_kill", "--memory-requests", "40",
                            "--burst-every", "12"])


@pytest.fixture(scope="module")
def app(args):
    from load_tests.soak.cluster import LocalApp, write_key_file

    key_file = write_key_file(args.api_key)
    try:
        app = LocalApp(soak.own_app_args(key_file, args.max_waiting, None), num_workers=2)
        try:
            yield app
        finally:
            app.close()
    finally:
        os.unlink(key_file)


@pytest.fixture(scope="module")
def soaked(args, app):
    report = asyncio.run(soak.soak(args, app))
    print(json.dumps(report))
    print(table(report))
    return report


def test_every_invariant_holds(soaked):
    assert set(soaked["invariants"]) == INVARIANTS
    assert soaked["violations"] == [] and soaked["passed"]


def test_the_run_covered_the_mix_and_the_fault(soaked):
    assert soaked["hung"] == 0 and soaked["completed"] > 100
    assert {"completion", "completion_stream", "chat", "chat_stream", "echo", "multi",
            "disconnect", "burst", "bad", "edge"} <= set(soaked["kinds"])
    assert soaked["bad_cases_sent"] == soaked["bad_cases_defined"]
    assert {"400", "401", "404", "405", "413", "429"} <= set(soaked["rejected"])
    assert [f["name"] for f in soaked["faults"]] == ["worker_kill", "router_kill"]
    assert all(f["recovery_s"] is not None for f in soaked["faults"])
    assert len(soaked["kv"]) == 2 and all(w["free_blocks"] == w["total_blocks"]
                                          for w in soaked["kv"])
    assert len(soaked["rss_mib"]) == 2
