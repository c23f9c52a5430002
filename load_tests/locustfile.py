"""The soak's request mix for Locust users (``soak/``: same requests, same checks).

    .venv/bin/locust -f load_tests/locustfile.py --host http://127.0.0.1:8000 --headless \\
        -u 32 -r 8 -t 5m --api-key "$KEY" --max-tokens-limit 128 --only-summary

Each user sends the mix of the soak (greedy completions and chats, streamed or not, echo,
two prompts with n=2, streams dropped mid-way, every kind of bad request) back to back. An
answer counts as a Locust failure when it breaks a promise the soak checks (not its request's
tokens, a 5xx, an error outside OpenAI's shape, a bad request without its 4xx, a 429 without
``Retry-After``); a 429 with ``Retry-After`` and the expected 4xx count as successes, listed
under their own names. Overload comes from the user count (more users than
``max_waiting_requests``). At the end it waits for the Workers to go idle and prints one JSON
line with the invariants, and exits nonzero when one broke. No faults are injected: the soak
does that on its own cluster. The host must be this machine (loopback).

Locust imports this file by its path, not as part of a package: it puts the repository on
``sys.path`` to import the mix from ``load_tests.soak``.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import locust  # noqa: F401  (first: gevent patches ssl before requests imports it)
import requests
from locust import HttpUser, constant, events, task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository
from load_tests.soak.mix import Mix, require_loopback  # noqa: E402
from load_tests.soak.report import workers_idle  # noqa: E402
from load_tests.soak.spec import (  # noqa: E402
    REQUEST_INVARIANTS,
    Limits,
    References,
    Spec,
    Verdict,
)
from load_tests.soak.verify import verify  # noqa: E402

STATE: dict = {"mix": None, "refs": References(), "problems": Counter(), "examples": []}


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--api-key", default="", help="the server's API key")
    parser.add_argument("--max-n", type=int, default=16, help="the server's max_n")
    parser.add_argument("--max-tokens-limit", type=int, default=0,
                        help="the server's max_tokens_limit (0: none)")
    parser.add_argument("--max-waiting", type=int, default=1024,
                        help="the server's max_waiting_requests")
    parser.add_argument("--max-body-bytes", type=int, default=4 << 20,
                        help="the server's max_request_body_bytes")
    parser.add_argument("--bad-fraction", type=float, default=0.1)
    parser.add_argument("--deadline", type=float, default=60.0)


@events.test_start.add_listener
def _start(environment, **_) -> None:
    opts = environment.parsed_options
    require_loopback(environment.host)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    card = requests.get(environment.host.rstrip("/") + "/v1/models", headers=headers,
                        timeout=30).json()["data"][0]
    limits = Limits(model=card["id"], max_model_len=card["max_model_len"],
                    max_body_bytes=opts.max_body_bytes, max_n=opts.max_n,
                    max_tokens_limit=opts.max_tokens_limit or None,
                    max_waiting_requests=opts.max_waiting, api_key=opts.api_key or None)
    STATE["mix"] = Mix(limits, seed=int(time.time()), id_prefix=f"locust{int(time.time())}")


@events.test_stop.add_listener
def _stop(environment, **_) -> None:
    mix = STATE["mix"]
    if mix is None:
        return
    stats, deadline = {}, time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = requests.get(environment.host.rstrip("/") + "/v1/stats",
                             headers=mix.headers(), timeout=30).json()
        if workers_idle(stats.get("workers", [])):
            break
        time.sleep(1)
    workers = stats.get("workers", [])
    invariants = {name: not STATE["problems"][name] for name in REQUEST_INVARIANTS}
    invariants["kv_free_queues_empty"] = bool(workers) and workers_idle(workers)
    print(json.dumps({"invariants": invariants, "problems": dict(STATE["problems"]),
                      "examples": STATE["examples"][:10],
                      "kv": [(w["replica"], w["num_free_blocks"], w["num_total_blocks"])
                             for w in workers]}))
    if not all(invariants.values()):
        environment.process_exit_code = 1


class SoakUser(HttpUser):
    """Sends the soak mix back to back."""

    wait_time = constant(0)

    @task
    def one_request(self) -> None:
        mix: Mix = STATE["mix"]
        bad = mix.rng.random() < self.environment.parsed_options.bad_fraction
        self.send(mix.random_bad() if bad else mix.random_valid())

    def send(self, spec: Spec) -> None:
        headers = {**spec.headers, "X-Request-Id": spec.request_id}
        data = _chunks(spec.body) if spec.chunked and spec.body is not None else spec.body
        timeout = self.environment.parsed_options.deadline
        with self.client.request(spec.method, spec.path, data=data, headers=headers,
                                 stream=spec.stream, timeout=timeout, catch_response=True,
                                 name=spec.kind) as resp:
            try:
                if resp.status_code == 0:  # Locust's session caught a connection error
                    raise resp.error or requests.exceptions.ConnectionError("no answer")
                verdict = self.judge(spec, resp)
            except requests.exceptions.Timeout:
                self.record(("no_hung", f"{spec.kind}: no answer within {timeout}s"))
                resp.failure("hung")
                return
            except (requests.exceptions.RequestException, OSError) as exc:
                self.record(("no_unexpected_failures", f"{spec.kind}: {exc!r}"))
                resp.failure(f"transport: {type(exc).__name__}")
                return
            for problem in verdict.problems:
                self.record(problem)
            if verdict.category == "failed" and not spec.bad:
                self.record(("no_unexpected_failures", f"{spec.kind}: {verdict.detail}"))
            if verdict.problems or verdict.category == "failed":
                resp.failure(f"{verdict.detail or resp.status_code}: {verdict.problems[:1]}")
            else:
                resp.success()

    @staticmethod
    def judge(spec: Spec, resp: requests.Response) -> Verdict:
        headers = {k.lower(): v for k, v in resp.headers.items()}
        if resp.status_code == 200 and spec.stream:
            events_, done = [], False
            for raw in resp.iter_lines():
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: "):
                    continue
                events_.append(line[6:])
                if spec.disconnect_after is not None and len(events_) >= spec.disconnect_after:
                    resp.close()  # the client goes away mid-stream
                    break
                done = done or events_[-1] == "[DONE]"
            return verify(spec, 200, headers, events_, STATE["refs"], done)
        return verify(spec, resp.status_code, headers, resp.content, STATE["refs"])

    @staticmethod
    def record(problem: tuple[str, str]) -> None:
        STATE["problems"][problem[0]] += 1
        if len(STATE["examples"]) < 50:
            STATE["examples"].append(f"{problem[0]}: {problem[1]}")


def _chunks(data: bytes, size: int = 16384):
    for i in range(0, len(data), size):
        yield data[i:i + size]

