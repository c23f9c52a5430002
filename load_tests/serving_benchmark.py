"""Serving benchmark: streaming requests against an OpenAI-compatible server on this machine.

    python load_tests/serving_benchmark.py --url http://127.0.0.1:8000 --num-prompts 256 \
        --max-concurrency 64 --input-len 128 --output-len 64 --request-rate inf

Arrivals are Poisson (``--arrival poisson``, the default) or evenly spaced (``fixed``) at
``--request-rate`` requests/s (``inf``: all at once, bounded by ``--max-concurrency``). Prompts
are random words or random token ids; input and output lengths are drawn uniformly from
``len * [1 - range_ratio, 1 + range_ratio]``. The run stops after ``--num-prompts`` requests or
``--duration`` seconds, whichever comes first (requests still running then are cancelled and
not counted). Prints one JSON line with the metrics, defined as in vLLM's ``bench serve``:

* TTFT: time from sending the request to the first streamed token chunk;
* TPOT: per request, (e2e latency - TTFT) / (output tokens - 1), requests with > 1 token;
* ITL: the gaps between consecutive streamed chunks, over all requests;
* E2E: time from sending to the last chunk;
* output tokens: the client's own count (``stream_check.py``: the chunks' token ids, asked
  for with ``return_token_ids`` unless ``--no-token-ids``), checked against ``usage``.

A request fails (``failed``, ``failed_by_reason``, one ``failure_examples`` message per reason;
not in the metrics) on a status other than 200, a connection error or timeout, or a stream that
``stream_check.failure`` rejects: an SSE error event, no ``[DONE]`` or ``finish_reason``, usage
that disagrees with the count, and under ``ignore_eos`` (the default) a count other than
``max_tokens``. Then the JSON line is still printed, stderr names the failures, the exit is 1.

Only loopback addresses are accepted: this is a load generator, not a network tool.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_check import StreamCount, failure  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work "
         "week case point government company number group problem fact river cache block token "
         "model layer batch queue stream paged kernel memory value key score light ocean stars "
         "city mountain book poem wind moon morning quick brown fox lazy dog").split()


@dataclass
class Result:
    status: int = 0
    reason: str = ""  # why the request failed (stream_check's reasons, "status N", ...); "": ok
    error: str = ""  # what the server or the connection said about it, shortened
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    index: int = 0
    sent_at: float = 0.0  # seconds after the run's start
    itl: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.reason


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if not host:
        raise SystemExit(f"--url {url!r} has no host")
    addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"--url must point at this machine (loopback), got {host} -> "
                         f"{sorted(addrs)}")


def sample_lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def make_prompt(rng: random.Random, length: int, mode: str, vocab_size: int) -> str | list[int]:
    if mode == "tokens":
        return [rng.randrange(10, vocab_size) for _ in range(length)]
    return " ".join(rng.choice(WORDS) for _ in range(length))


def arrival_gaps(rng: random.Random, rate: float, kind: str, n: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    if kind == "fixed":
        return [1.0 / rate] * n
    return [rng.expovariate(rate) for _ in range(n)]


def request_body(args: argparse.Namespace, model: str, prompt: str | list[int],
                 output_len: int) -> tuple[str, dict]:
    body: dict = {"model": model, "max_tokens": output_len, "temperature": args.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.token_ids:  # vLLM's field: the chunks carry their token ids, counted by the client
        body["return_token_ids"] = True
    for name in ("top_p", "top_k", "repetition_penalty"):  # only when given (vLLM's names)
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.endpoint == "chat":
        text = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


async def send(session: aiohttp.ClientSession, url: str, body: dict, prompt_len: int) -> Result:
    res = Result(prompt_len=prompt_len)
    count = StreamCount()
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.reason, res.error = f"status {resp.status}", (await resp.text())[:200]
                return res
            async for raw in resp.content:
                if not count.feed(raw.decode(errors="replace")):
                    continue
                now = time.perf_counter()
                if count.text_chunks == 1:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    except asyncio.TimeoutError as exc:
        res.reason, res.error = "timeout", repr(exc)
        return res
    except aiohttp.ClientError as exc:
        res.reason, res.error = "connection error", repr(exc)[:200]
        return res
    res.e2e = last - start
    res.output_tokens = count.tokens()
    res.reason = failure(count, body["max_tokens"], body.get("ignore_eos", False))
    res.error = count.error or (count.describe() if res.reason else "")
    return res


async def fetch_model(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(f"{base}/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    n = args.num_prompts
    in_lens = sample_lengths(rng, args.input_len, args.range_ratio, n)
    out_lens = sample_lengths(rng, args.output_len, args.range_ratio, n)
    prompts = [make_prompt(rng, k, args.prompt_mode, args.vocab_size) for k in in_lens]
    gaps = arrival_gaps(rng, args.request_rate, args.arrival, n)
    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=conn) as session:
        model = args.model or await fetch_model(session, base)
        bar = tqdm(total=n, desc="requests", unit="req", file=sys.stderr, disable=args.no_progress)

        async def one(i: int) -> Result:
            async with limit:
                path, body = request_body(args, model, prompts[i], out_lens[i])
                sent_at = time.perf_counter() - start
                res = await send(session, base + path, body, in_lens[i])
            res.index, res.sent_at = i, sent_at
            bar.update(1)
            return res

        tasks: list[asyncio.Task] = []
        start = time.perf_counter()
        deadline = start + args.duration
        for i in range(n):
            if time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(gaps[i])
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        elapsed = time.perf_counter() - start
        bar.close()
    results = sorted((t.result() for t in done), key=lambda r: r.index)
    if args.save_details:
        with open(args.save_details, "w") as f:
            json.dump([{k: v for k, v in vars(r).items() if k != "itl"} for r in results], f)
    return summarize(args, model, results, len(pending), elapsed)


def _dist(name: str, values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {f"{name}_{k}": float("nan") for k in ("mean", "p50", "p90", "p99")}
    a = np.asarray(values) * scale
    return {f"{name}_mean": float(a.mean()), f"{name}_p50": float(np.percentile(a, 50)),
            f"{name}_p90": float(np.percentile(a, 90)), f"{name}_p99": float(np.percentile(a, 99))}


def summarize(args: argparse.Namespace, model: str, results: list[Result], cancelled: int,
              elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    reasons: dict[str, int] = {}
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
            examples.setdefault(r.reason, r.error)
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "label": args.label, "url": args.url, "model": model, "endpoint": args.endpoint,
        "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "input_len": args.input_len, "output_len": args.output_len,
        "completed": len(ok), "failed": len(results) - len(ok), "failed_by_reason": reasons,
        "failure_examples": examples,
        "cancelled_at_deadline": cancelled, "duration_s": elapsed,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / elapsed, "output_throughput": out_tokens / elapsed,
    }
    summary.update(_dist("ttft_ms", [r.ttft for r in ok]))
    # the first max_concurrency requests arrive together (a burst the server has to queue);
    # the rest each arrive as one finishes: the steady state
    steady = [r.ttft for r in ok if r.index >= args.max_concurrency]
    summary["ttft_ms_p50_steady"] = _dist("t", steady)["t_p50"]
    summary.update(_dist("tpot_ms", tpot))
    summary.update(_dist("itl_ms", [g for r in ok for g in r.itl]))
    summary.update(_dist("e2el_ms", [r.e2e for r in ok]))
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--api-key", help="bearer token, if the server needs one")
    p.add_argument("--num-prompts", type=int, default=200, help="requests to send at most")
    p.add_argument("--duration", type=float, default=600.0, help="stop after this many seconds")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    p.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length (words/ids)")
    p.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len*[1-r, 1+r]")
    p.add_argument("--prompt-mode", choices=("words", "tokens"), default="words")
    p.add_argument("--vocab-size", type=int, default=700, help="token-id range for tokens mode")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let EOS end requests early (default: generate exactly max_tokens)")
    p.add_argument("--no-token-ids", dest="token_ids", action="store_false",
                   help="no return_token_ids (count text chunks, checked against usage)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds between reads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="free text copied into the JSON line")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--save-details", metavar="PATH",
                   help="write every request's index, send time, TTFT, latency and tokens (JSON)")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.max_concurrency < 1 or args.duration <= 0:
        p.error("--num-prompts, --max-concurrency and --duration must be positive")
    if not 0.0 <= args.range_ratio < 1.0:
        p.error("--range-ratio must be in [0, 1)")
    check_loopback(args.url)
    return args


def main(argv: list[str] | None = None) -> None:
    """Print the run's JSON line; exit 1 when any request failed (they are named on stderr)."""
    args = parse_args(argv)
    summary = asyncio.run(run(args))
    print(json.dumps(summary), flush=True)
    if summary["failed"]:
        raise SystemExit(f"serving_benchmark: {summary['failed']} of "
                         f"{summary['completed'] + summary['failed']} requests failed "
                         f"(run {args.label or args.url!r}): {summary['failed_by_reason']}; "
                         f"e.g. {summary['failure_examples']}")


if __name__ == "__main__":
    main()
