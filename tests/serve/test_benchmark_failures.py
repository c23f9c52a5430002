"""The serving benchmarks count failures as failures: ``serving_benchmark.py`` and
``big_prompt_itl.py`` against a small fake OpenAI server on 127.0.0.1 that misbehaves on
purpose (an SSE error mid-stream, fewer tokens than ``max_tokens`` under ``ignore_eos`` while
``usage`` claims them all, a 500, ...), and ``stream_check``'s verdicts one by one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "load_tests"))

import big_prompt_itl  # noqa: E402
import serving_benchmark  # noqa: E402
from stream_check import StreamCount, failure  # noqa: E402

# what this app's Router sends when a request fails mid-stream (serve_app/router/router.py, _sse)
ERROR_EVENT = {"error": {"message": "Worker died", "type": "internal_server_error",
                         "param": None, "code": None}}


def _chunk(text: str, ids: list[int] | None, finish: str | None = None) -> dict:
    choice: dict = {"index": 0, "text": text, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


def events(mode: str, body: dict) -> list[dict | str]:
    """The SSE events of one streamed completion: right (``ok``: a token a chunk; ``merged``:
    three a chunk) or wrong in one way (the other modes)."""
    n, want_ids = body["max_tokens"], body.get("return_token_ids", False)
    produced = n - 3 if mode == "short" else n
    step = 3 if mode == "merged" else 1
    out: list[dict | str] = []
    for start in range(0, produced, step):
        ids = list(range(start, min(start + step, produced)))
        last = start + step >= produced and mode != "no-finish"
        out.append(_chunk("".join(f" t{i}" for i in ids), ids if want_ids else None,
                          "length" if last else None))
    if mode == "sse-error":  # as this app's Router: the error event, then [DONE]
        return [*out[:2], ERROR_EVENT, "[DONE]"]
    if (body.get("stream_options") or {}).get("include_usage"):
        out.append({"id": "cmpl-1", "choices": [], "usage": {  # "short" claims them all
            "prompt_tokens": 4, "completion_tokens": n, "total_tokens": n + 4}})
    return out if mode == "no-done" else [*out, "[DONE]"]


def fake_app(mode: str) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if mode == "status-500" or not body.get("stream"):  # the big prompts: refused
            status = 500 if mode == "status-500" else 400
            return web.json_response({"error": {"message": "no", "type": "x"}}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events(mode, body):
            data = event if isinstance(event, str) else json.dumps(event)
            await resp.write(f"data: {data}\n\n".encode())
            await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@contextmanager
def fake_server(mode: str) -> Iterator[str]:
    """The fake app on a free loopback port, in a thread of its own; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake_app(mode))
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


BENCH_ARGS = ["--num-prompts", "4", "--max-concurrency", "2", "--input-len", "8",
              "--output-len", "8", "--duration", "60", "--request-timeout", "10", "--no-progress"]


def bench(url: str, capsys, *extra: str) -> tuple[dict, object]:
    """serving_benchmark's JSON line and its exit code (None: it returned normally)."""
    code = None
    try:
        serving_benchmark.main(["--url", url, *BENCH_ARGS, *extra])
    except SystemExit as exc:
        code = exc.code
    return json.loads(capsys.readouterr().out.splitlines()[-1]), code


@pytest.mark.parametrize("mode", ["ok", "merged"])
def test_a_right_server_counts_every_request_as_completed(mode, capsys):
    with fake_server(mode) as url:
        line, code = bench(url, capsys)
    assert code is None
    assert (line["completed"], line["failed"], line["failed_by_reason"]) == (4, 0, {})
    assert line["total_output_tokens"] == 4 * 8  # counted from the chunks' token ids


@pytest.mark.parametrize("mode, reason", [
    ("sse-error", "sse error"),  # an error event mid-stream, then [DONE]: not a success
    ("short", "short output"),  # 5 tokens under ignore_eos, usage claiming max_tokens=8
    ("status-500", "status 500"),
    ("no-done", "no [DONE]"),
    ("no-finish", "no finish_reason"),
])
def test_a_failing_server_counts_every_request_as_failed(mode, reason, capsys):
    with fake_server(mode) as url:
        line, code = bench(url, capsys, "--label", "bad run")
    assert (line["completed"], line["failed"], line["failed_by_reason"]) == (0, 4, {reason: 4})
    assert line["total_output_tokens"] == 0 and line["output_throughput"] == 0
    assert isinstance(code, str) and code.startswith(  # a message: exit status 1
        f"serving_benchmark: 4 of 4 requests failed (run 'bad run'): {{'{reason}': 4}}")
    if mode == "sse-error":
        assert "Worker died" in line["failure_examples"]["sse error"]


def test_the_script_exits_nonzero_when_requests_fail():
    script = str(ROOT / "load_tests" / "serving_benchmark.py")
    for mode, want in (("ok", 0), ("short", 1)):
        with fake_server(mode) as url:
            proc = subprocess.run([sys.executable, script, "--url", url, *BENCH_ARGS],
                                  capture_output=True, text=True, timeout=120)
        assert proc.returncode == want, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["failed"] == 4 * want
        assert ("{'short output': 4}" in proc.stderr) == bool(want)


def test_big_prompt_itl_counts_failed_streams(capsys):
    argv = ["--num-streams", "2", "--stream-tokens", "8", "--num-big", "1", "--big-bytes",
            "1000", "--settle-s", "0", "--timeout", "30"]
    with fake_server("ok") as url:
        big_prompt_itl.main(["--url", url, *argv])
    assert json.loads(capsys.readouterr().out)["streams_ok"] == 2
    with fake_server("sse-error") as url, pytest.raises(SystemExit) as exc:
        big_prompt_itl.main(["--url", url, *argv])
    line = json.loads(capsys.readouterr().out)
    assert (line["streams_ok"], line["streams_failed_by_reason"]) == (0, {"sse error": 2})
    assert "2 of 2 streams failed" in str(exc.value.code)


def _count(*events: dict | str) -> StreamCount:
    count = StreamCount()
    for e in events:
        count.feed(f"data: {e if isinstance(e, str) else json.dumps(e)}")
    return count


def test_stream_check_verdicts():
    full = [_chunk(" a b", [1, 2]), _chunk("", [3]), _chunk(" c", [4], "length")]
    usage = {"choices": [], "usage": {"completion_tokens": 4}}
    assert failure(_count(*full, usage, "[DONE]"), 4, ignore_eos=True) == ""
    assert _count(*full, usage, "[DONE]").tokens() == 4
    # vLLM's older error event, outside an "error" key
    assert failure(_count(full[0], {"object": "error", "message": "x"}, "[DONE]"), 4, True) \
        == "sse error"
    assert failure(_count(full[0], "{not json", "[DONE]"), 4, True) == "bad chunk"
    bad_usage = {"choices": [], "usage": {"completion_tokens": 5}}
    assert failure(_count(*full, bad_usage, "[DONE]"), 4, True) == "usage mismatch"
    assert failure(_count(*full, "[DONE]"), 3, False) == "long output"
    # EOS before max_tokens: fine without ignore_eos, short with it
    stopped = [_chunk(" a", [1]), _chunk(" b", [2], "stop"), "[DONE]"]
    assert failure(_count(*stopped), 4, ignore_eos=False) == ""
    assert failure(_count(*stopped), 4, ignore_eos=True) == "short output"
    # no token ids and no usage: the text chunks are the count
    assert failure(_count(_chunk(" a", None), _chunk(" b", None, "length"), "[DONE]"), 2,
                   True) == ""
    assert failure(_count(_chunk("", [1], "length"), "[DONE]"), 1, True) == "no output"


def test_this_apps_own_stream_passes_and_its_error_event_fails():
    """The Router's shapes (serve_app/router/responses.py, router.py's _sse): merged steps, a token
    whose text is held back, usage, [DONE]; and a request failing mid-stream."""
    from serve_app.protocol.errors import APIError
    from serve_app.router.completion_format import CompletionFormat
    from serve_app.router.responses import SSE_DONE, sse
    from serve_app.router.streams import Delta, Usage

    def stream(steps_sent: int, tail: list[str]) -> StreamCount:
        fmt = CompletionFormat("cmpl-1", "m", None, 1, prompt_token_ids=[[1, 2, 3]])
        steps = [[Delta(0, " a b", [5, 6])], [Delta(0, "", [7])], [Delta(0, " c", [8], "length")]]
        events = [sse(c) for step in steps[:steps_sent] for c in fmt.stream_chunks(step)]
        count = StreamCount()
        for line in "".join([*events, *tail]).splitlines():
            count.feed(line)
        return count

    usage = CompletionFormat("cmpl-1", "m", None, 1).usage_chunk(Usage(3, 4))
    done = stream(3, [sse(usage), SSE_DONE])
    assert (failure(done, 4, ignore_eos=True), done.tokens(), done.text_chunks) == ("", 4, 2)
    failed = stream(1, [sse(APIError(500, "Worker died").body()), SSE_DONE])
    assert failure(failed, 4, ignore_eos=True) == "sse error" and "Worker died" in failed.error
