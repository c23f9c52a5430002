"""Soak: a bounded run of mixed traffic, bad input, overload and faults against pagedserve.

    python -m load_tests.soak --duration 600 --concurrency 12        # starts its own app
    python -m load_tests.soak --url http://127.0.0.1:8000 --duration 120 --concurrency 8

Without ``--url`` it starts one local Ray cluster on 127.0.0.1 with the app (default model,
2 Workers, 2 Routers, an API key, a small admission bound) and injects faults during the run:
a Worker replica's process killed, a Router replica's process killed, the Workers scaled
2 -> 1 while busy and back to 2 (``--faults`` picks them). With ``--url`` (loopback only) it
sends the same traffic to a running app, without faults.

The traffic (``mix.py``, ``cases.py``): greedy completions and chats, streamed or not, over prompts that
share prefixes; echo; two prompts with n=2; streams dropped by the client mid-way; every kind
of bad request; bursts above the admission bound. After the run it waits for the Workers to go
idle, then runs two equal fault-free passes and compares the replicas' memory.

It prints one JSON line and a table, and exits nonzero when an invariant breaks:

* ``no_hung``: every request ended within ``--deadline``;
* ``belongs``: every answer is its request's (response id, greedy text equal to the reference
  for its prompt, choice count and indices, one finish per choice, usage);
* ``errors_openai_shape``: every error answer is ``{"error": {message, type, param, code}}``;
* ``bad_input_4xx``: each bad request got its 4xx, never a 5xx; unusual valid input a 200;
* ``overload_429``: bursts above the bound got 429s, each with ``Retry-After``;
* ``no_unexpected_failures``: no valid request failed outside a Worker/Router kill window;
* ``worker_kill``/``router_kill``: requests in flight got a clear error or completed, Serve
  replaced the replica within ``RECOVERY_TIMEOUT_S`` (180 s) and requests succeed afterwards;
* ``scale_down``: the Worker count went 2 -> 1 under load and no request failed meanwhile;
* ``disconnect_aborts``: on idle Workers after the run, streams the client drops after their
  first chunks (``ignore_eos``, so none would end by itself soon) are each aborted at their
  Worker (``aborted_total``) and stop generating before their ``max_tokens``;
* ``kv_free_queues_empty``: afterwards each Worker's free KV blocks equal its total, its
  waiting and running queues are empty, and so are the Router's;
* ``memory_stable``: no replica's RSS grew by more than ``--memory-slack-mib`` (or 5%) from
  the first fault-free pass to the second;
* ``api_key_not_logged``: (own app) neither the API key nor a wrong key sent appears in any
  log file of the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from .mix import require_loopback
from .report import Fault, summarize, table
from .runner import Runner
from .spec import Limits

if TYPE_CHECKING:
    from .cluster import LocalApp

MAX_DURATION_S = 3600.0
MAX_CONCURRENCY = 64
ALL_FAULTS = ("worker_kill", "router_kill", "scale_down")
DISCONNECT_CHECKS = 4  # dropped streams on idle Workers after the run, each counted aborted


def own_app_args(api_key_file: str | None, max_waiting: int, model: str | None) -> dict:
    """The app the soak starts: small bounds so that overload and limits are reached. The key
    comes from a file, as in production (``args`` are visible in ``serve status``)."""
    args = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 8 << 20,
            "num_threads": 1, "accelerator": "cpu", "worker_num_cpus": 0.5,
            "router_num_cpus": 0.25, "num_routers": 2, "routing_stats_period_s": 0.5,
            "health_check_period_s": 2.0, "max_batch_size": 8, "batch_wait_ms": 5,
            "max_waiting_requests": max_waiting, "max_request_body_bytes": 64 << 10,
            "max_n": 4, "max_tokens_limit": 128, "worker_drain_timeout_s": 60.0,
            "max_num_seqs": 4,  # requests queue in the Workers too: a killed one holds some
            "api_key_file": api_key_file}
    if model:
        args["model"] = model
    return args


# ---- the run -----------------------------------------------------------------------------------

async def discover(url: str, args: argparse.Namespace) -> Limits:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models", headers=headers) as resp:
            card = (await resp.json())["data"][0]
    return Limits(model=card["id"], max_model_len=card["max_model_len"],
                  max_body_bytes=args.max_body_bytes, max_n=args.max_n,
                  max_tokens_limit=args.max_tokens_limit,
                  max_waiting_requests=args.max_waiting, api_key=args.api_key)


async def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1.0)
    raise SystemExit(f"{url}/health did not answer 200 within {timeout_s:.0f}s")


async def soak(args: argparse.Namespace, app: LocalApp | None = None) -> dict:
    """Run the soak against ``args.url`` (or ``app``, a ``LocalApp``); the report."""
    url = app.url if app is not None else args.url
    await wait_healthy(url)
    runner = Runner(url, await discover(url, args), args.deadline, args.seed)
    faults_log: list[Fault] = []
    memory: list[dict[str, int]] = []
    connector = aiohttp.TCPConnector(limit=args.concurrency + args.burst_size + 16)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        until = runner.now() + args.duration
        tasks = [runner.clients(session, args.concurrency, until, args.bad_fraction),
                 runner.every_bad_case(session)]
        if args.burst_size:
            tasks.append(runner.bursts(session, args.burst_size, args.burst_every, until))
        if app is not None and args.faults:
            from .faults import Faults

            faults = Faults(app, runner, session)
            faults_log = faults.log
            step = args.duration / (len(args.faults) + 1)
            tasks.append(faults.run(args.faults, [step * (k + 1) for k in
                                                   range(len(args.faults))]))
        await asyncio.gather(*tasks)
        workers = app.num_workers if app is not None else None
        after_main = await runner.settle(session, workers)
        runner.phase = "disconnects"
        dropped = await runner.disconnects_abort(session, DISCONNECT_CHECKS, workers)
        final = after_main
        for k in range(2 if args.memory_requests else 0):
            runner.phase = f"memory{k + 1}"
            await runner.clients(session, args.concurrency, float("inf"),
                                 limit=args.memory_requests)
            final = await runner.settle(session, workers)
            memory.append(await read_memory(runner, session, app))
    report = summarize(runner, faults_log, after_main, final, memory, args)
    report["invariants"]["disconnect_aborts"] = not dropped
    report["violations"] += [f"disconnect_aborts: {p}" for p in dropped]
    if app is not None:
        report["retried_after_worker_death"] = app.retried_requests()
    if app is not None and args.api_key:
        leaked = app.find_in_logs([args.api_key, "wrong-key-"])
        report["invariants"]["api_key_not_logged"] = not leaked
        if leaked:
            report["violations"].append(f"api key in logs: {leaked[:5]}")
    report["passed"] = all(report["invariants"].values())
    return report


async def read_memory(runner: Runner, session: aiohttp.ClientSession,
                      app: LocalApp | None) -> dict[str, int]:
    """RSS per replica: from the processes (own app) or from ``/v1/stats`` (``--url``)."""
    if app is not None:
        return await asyncio.to_thread(app.rss_bytes)
    stats = await runner.stats(session)
    return {f"Worker/{w['replica']}": int(w["rss_bytes"]) for w in stats.get("workers", [])
            if w.get("rss_bytes")}


# ---- command line ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m load_tests.soak",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running app on this machine (loopback only); default: "
                   "start one on a local Ray cluster, with faults")
    p.add_argument("--duration", type=float, default=120.0,
                   help=f"seconds of mixed traffic (at most {MAX_DURATION_S:.0f})")
    p.add_argument("--concurrency", type=int, default=8,
                   help=f"client loops (at most {MAX_CONCURRENCY})")
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a request may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bad-fraction", type=float, default=0.1)
    p.add_argument("--burst-size", type=int, default=None,
                   help="requests per burst (default: twice the admission bound + 4 for the "
                   "own app, none with --url); capped at 256")
    p.add_argument("--burst-every", type=float, default=20.0)
    p.add_argument("--faults", default=",".join(ALL_FAULTS),
                   help=f"own app: comma-separated from {', '.join(ALL_FAULTS)}, or none")
    p.add_argument("--memory-requests", type=int, default=200,
                   help="requests per fault-free memory pass (0: skip the memory check)")
    p.add_argument("--memory-slack-mib", type=float, default=32.0)
    p.add_argument("--api-key", help="the server's API key (--url); the own app makes one")
    p.add_argument("--no-auth", action="store_true", help="own app: no API key")
    p.add_argument("--model", help="own app: checkpoint folder (default: the default model)")
    p.add_argument("--max-waiting", type=int, help="the server's max_waiting_requests")
    p.add_argument("--max-body-bytes", type=int, help="the server's max_request_body_bytes")
    p.add_argument("--max-n", type=int, help="the server's max_n")
    p.add_argument("--max-tokens-limit", type=int, help="the server's max_tokens_limit")
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args(argv)
    return finish_args(args)


def finish_args(args: argparse.Namespace) -> argparse.Namespace:
    """Caps, and the defaults that depend on whether the soak starts its own app."""
    args.duration = min(max(args.duration, 1.0), MAX_DURATION_S)
    args.concurrency = min(max(args.concurrency, 1), MAX_CONCURRENCY)
    args.deadline = min(max(args.deadline, 1.0), 600.0)
    own = args.url is None
    if own:
        args.api_key = None if args.no_auth else (args.api_key or secrets.token_urlsafe(24))
    defaults = {"max_waiting": 16 if own else 1024, "max_body_bytes": 65536 if own else 4 << 20,
                "max_n": 4 if own else 16, "max_tokens_limit": 128 if own else None}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.burst_size is None:
        args.burst_size = 2 * args.max_waiting + 4 if own else 0
    args.burst_size = min(max(args.burst_size, 0), 256)
    names = [] if args.faults in ("", "none") else args.faults.split(",")
    unknown = set(names) - set(ALL_FAULTS)
    if unknown:
        raise SystemExit(f"--faults: unknown {sorted(unknown)}; known: {', '.join(ALL_FAULTS)}")
    args.faults = names if own else []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    app, key_file = None, None
    if args.url:
        require_loopback(args.url)
        args.url = args.url.rstrip("/")
    try:
        if not args.url:
            from .cluster import LocalApp, write_key_file

            key_file = write_key_file(args.api_key) if args.api_key else None
            app = LocalApp(own_app_args(key_file, args.max_waiting, args.model), num_workers=2)
        report = asyncio.run(soak(args, app))
    finally:
        if app is not None:
            app.close()
        if key_file is not None:
            Path(key_file).unlink(missing_ok=True)
    print(json.dumps(report))
    if not args.json_only:
        print(table(report))
        for v in report["violations"][:20]:
            print("violation:", v)
    return 0 if report["passed"] else 1

