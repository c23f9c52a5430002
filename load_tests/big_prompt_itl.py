"""Inter-token latency of running streams while maximal prompts arrive (loopback only).

32 streams (token-id prompts, ``--stream-tokens`` each, ignore_eos) run against the server; once
every stream has its first token, ``--num-big`` prompts of ``--big-bytes`` of text arrive (each
a whole request body near the Router's 4 MiB limit). They take the Router's prompt preparation
(templating, tokenizing) to its maximum and are then refused for their length. Prints one JSON
line per server: the streams' inter-token latency (gaps between consecutive text chunks of a
stream) while the big prompts are in flight and outside that window, and the big requests'
statuses.
A stream that fails (a status other than 200, or one ``stream_check.failure`` rejects: an SSE
error event, no ``[DONE]``, fewer than ``--stream-tokens`` tokens, ...) or a big request
answered with a 5xx is counted in the line (``streams_failed_by_reason``, ``big_5xx``), and
the script exits 1 after measuring every server.

    .venv/bin/python load_tests/big_prompt_itl.py --url http://127.0.0.1:8000 --label after

Give ``--url`` several times (``label=URL``) to measure servers one after the other in the same
invocation, e.g. this app and ``vllm serve`` (``../shared/peer/README.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_benchmark import check_loopback, fetch_model  # noqa: E402
from stream_check import StreamCount, failure  # noqa: E402


async def _stream(session: aiohttp.ClientSession, url: str, body: dict, times: list[float],
                  started: asyncio.Event) -> str:
    """Time the stream's text chunks; return why it failed ("" when it did not)."""
    count = StreamCount()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return f"status {resp.status}"
            async for raw in resp.content:
                if count.feed(raw.decode(errors="replace")):
                    times.append(time.monotonic())
                    started.set()
    except aiohttp.ClientError:
        return "connection error"
    finally:
        started.set()  # a failed stream sends no first token: not waited for
    return failure(count, body["max_tokens"], body["ignore_eos"])


async def _big(session: aiohttp.ClientSession, url: str, model: str, size: int) -> tuple[int, float]:
    word = "tokenization takes time "
    body = {"model": model, "prompt": word * (size // len(word)), "max_tokens": 1}
    start = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status, time.monotonic() - start


def _pcts(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"n": 0}
    gaps = sorted(gaps)
    pick = lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000.0  # noqa: E731
    return {"n": len(gaps), "p50_ms": round(pick(0.5), 2), "p99_ms": round(pick(0.99), 2),
            "max_ms": round(gaps[-1] * 1000.0, 2)}


async def measure(url: str, args: argparse.Namespace) -> dict:
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        model = await fetch_model(session, url)
        streams = [[] for _ in range(args.num_streams)]
        firsts = [asyncio.Event() for _ in range(args.num_streams)]
        bodies = [{"model": model, "prompt": [1 + (i * 7 + j) % 600 for j in range(64)],
                   "max_tokens": args.stream_tokens, "ignore_eos": True, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}}
                  for i in range(args.num_streams)]
        tasks = [asyncio.create_task(_stream(session, url, b, t, e))
                 for b, t, e in zip(bodies, streams, firsts, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), args.timeout)
        await asyncio.sleep(args.settle_s)
        window_start = time.monotonic()
        big = await asyncio.gather(*(_big(session, url, model, args.big_bytes)
                                     for _ in range(args.num_big)))
        window_end = time.monotonic()
        verdicts = await asyncio.gather(*tasks)
    inside, outside = [], []
    for times in streams:
        for a, b in zip(times, times[1:]):
            (inside if b > window_start and a < window_end else outside).append(b - a)
    reasons: dict[str, int] = {}
    for v in filter(None, verdicts):
        reasons[v] = reasons.get(v, 0) + 1
    return {"streams_ok": verdicts.count(""), "num_streams": args.num_streams,
            "streams_failed_by_reason": reasons, "big_5xx": sum(s >= 500 for s, _ in big),
            "big_statuses": sorted({s for s, _ in big}), "big_latency_s_max":
            round(max(d for _, d in big), 2), "window_s": round(window_end - window_start, 2),
            "itl_during_big_prompts": _pcts(inside), "itl_outside": _pcts(outside)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", action="append", help="[label=]base URL, loopback (repeatable)")
    p.add_argument("--label", default="", help="label of a single --url")
    p.add_argument("--num-streams", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=256, help="max_tokens of each stream")
    p.add_argument("--num-big", type=int, default=10, help="maximal prompts sent together")
    p.add_argument("--big-bytes", type=int, default=4_000_000, help="characters of each")
    p.add_argument("--settle-s", type=float, default=0.5, help="streaming before they arrive")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one server's run")
    args = p.parse_args(argv)
    args.url = args.url or ["http://127.0.0.1:8000"]
    return args


def main(argv: list[str] | None = None) -> None:
    """One JSON line per server; exit 1 when any server had failed streams or 5xx answers."""
    args = parse_args(argv)
    failed = []
    for entry in args.url:
        label, _, url = entry.partition("=") if "=" in entry else (args.label, "", entry)
        check_loopback(url)
        result = asyncio.run(measure(url.rstrip("/"), args))
        print(json.dumps({"label": label, "url": url, **result}), flush=True)
        bad = result["num_streams"] - result["streams_ok"]
        if bad or result["big_5xx"]:
            failed.append(f"{label or url}: {bad} of {result['num_streams']} streams failed "
                          f"{result['streams_failed_by_reason']}, {result['big_5xx']} big "
                          "prompts answered 5xx")
    if failed:
        raise SystemExit("big_prompt_itl: " + "; ".join(failed))


if __name__ == "__main__":
    main()
