"""The soak's client: sends the mix with aiohttp and keeps every request's ``Outcome``.

``Runner`` holds the seeded ``Mix``, the greedy ``References`` and the outcomes; its loops
(``clients``, ``bursts``, ``every_bad_case``) make the traffic, ``probe_until_ok`` tells when
the service has recovered from a fault, and ``settle`` waits for the Workers to go idle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp

from .mix import Mix
from .report import Outcome, idle
from .spec import Limits, References, Spec, Verdict
from .verify import verify

SETTLE_TIMEOUT_S = 60.0


class Runner:
    """Sends specs and keeps every outcome; times are seconds since the run started."""

    def __init__(self, url: str, limits: Limits, deadline_s: float, seed: int) -> None:
        self.url = url
        self.mix = Mix(limits, seed)
        self.refs = References()
        self.deadline_s = deadline_s
        self.outcomes: list[Outcome] = []
        self.t0 = time.monotonic()
        self.phase = "main"

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, session: aiohttp.ClientSession, spec: Spec, record: bool = True,
                   ) -> Outcome:
        start = self.now()
        headers = {**spec.headers, "X-Request-Id": spec.request_id}
        data = _chunks(spec.body) if spec.chunked and spec.body is not None else spec.body
        status, hung = 0, False
        try:
            async with asyncio.timeout(self.deadline_s):
                async with session.request(spec.method, self.url + spec.path, data=data,
                                           headers=headers) as resp:
                    status = resp.status
                    hdrs = {k.lower(): v for k, v in resp.headers.items()}
                    if status == 200 and spec.stream:
                        events, done = await _read_sse(resp, spec.disconnect_after)
                        if spec.disconnect_after is not None:
                            resp.close()  # the client goes away mid-stream
                        verdict = verify(spec, status, hdrs, events, self.refs, done)
                    else:
                        verdict = verify(spec, status, hdrs, await resp.read(), self.refs)
        except TimeoutError:
            hung = True
            verdict = Verdict("hung", [("no_hung", f"{spec.kind} {spec.request_id}: no answer "
                                        f"within {self.deadline_s}s")], detail="hung")
        except (aiohttp.ClientError, ConnectionError) as exc:
            verdict = Verdict("failed", [], False, detail=f"transport:{type(exc).__name__}")
        out = Outcome(spec, status, verdict, start, self.now(), hung, self.phase)
        if record:
            self.outcomes.append(out)
        return out

    async def clients(self, session: aiohttp.ClientSession, concurrency: int, until: float,
                      bad_fraction: float = 0.0, limit: int | None = None) -> None:
        """``concurrency`` loops sending the mix until ``until`` (or ``limit`` requests)."""
        budget = [limit if limit is not None else 10 ** 9]

        async def loop() -> None:
            while self.now() < until and budget[0] > 0:
                budget[0] -= 1
                bad = self.mix.rng.random() < bad_fraction
                await self.send(session, self.mix.random_bad() if bad else
                                self.mix.random_valid())

        await asyncio.gather(*(loop() for _ in range(concurrency)))

    async def bursts(self, session: aiohttp.ClientSession, size: int, every_s: float,
                     until: float) -> None:
        while self.now() + every_s < until:
            await asyncio.sleep(every_s)
            await asyncio.gather(*(self.send(session, self.mix.burst()) for _ in range(size)))

    async def every_bad_case(self, session: aiohttp.ClientSession) -> None:
        for case in self.mix.bad_cases:
            await self.send(session, self.mix.bad(case))

    async def probe_until_ok(self, session: aiohttp.ClientSession, timeout_s: float,
                             ) -> tuple[bool, list[str]]:
        """Send probes until one completes (a 429 just means later): whether one did, and
        what the failed ones got."""
        failed: list[str] = []
        deadline = self.now() + timeout_s
        while self.now() < deadline:
            out = await self.send(session, self.mix.probe(), record=False)
            if out.verdict.category == "completed":
                return True, failed
            if out.verdict.category != "rejected":
                failed.append(f"{out.status} {out.verdict.detail} {out.verdict.sample[:80]}")
            await asyncio.sleep(0.5)
        return False, failed

    async def disconnects_abort(self, session: aiohttp.ClientSession, count: int,
                                num_workers: int | None) -> list[str]:
        """On idle Workers, ``count`` streams dropped after their first chunks, each of which
        could run on to its ``max_tokens`` (``ignore_eos``): each must be aborted at its Worker
        (its abort counted, its generation cut short). What broke (empty: nothing)."""
        before = (await self.settle(session, num_workers)).get("total")
        specs = [self.mix.valid("disconnect") for _ in range(count)]  # ignore_eos, as all
        await asyncio.gather(*(self.send(session, spec) for spec in specs))
        after = (await self.settle(session, num_workers)).get("total")
        if not before or not after:
            return [f"no Worker totals in /v1/stats: {before} / {after}"]
        problems = []
        aborted = after["aborted_total"] - before["aborted_total"]
        if aborted < count:
            problems.append(f"{count} dropped streams, {aborted} aborts at the Workers")
        generated = after["generation_tokens_total"] - before["generation_tokens_total"]
        if generated >= sum(spec.max_tokens for spec in specs):
            problems.append(f"dropped streams ran to their end ({generated} tokens generated)")
        return problems

    async def stats(self, session: aiohttp.ClientSession) -> dict:
        async with session.get(self.url + "/v1/stats", headers=self.mix.headers(),
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return await resp.json()

    async def settle(self, session: aiohttp.ClientSession, num_workers: int | None) -> dict:
        """Wait (bounded) until every Worker is idle with all KV blocks free; last stats."""
        deadline, stats = self.now() + SETTLE_TIMEOUT_S, {}
        while self.now() < deadline:
            try:
                stats = await self.stats(session)
            except (aiohttp.ClientError, TimeoutError, ValueError):
                stats = {}
            if stats and idle(stats, num_workers):
                break
            await asyncio.sleep(0.5)
        return stats


async def _chunks(data: bytes, size: int = 16384) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


async def _read_sse(resp: aiohttp.ClientResponse, stop_after: int | None,
                    ) -> tuple[list[str], bool]:
    """The ``data:`` payloads in order, and whether ``[DONE]`` ended the stream."""
    events: list[str] = []
    try:
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if stop_after is not None and len(events) >= stop_after:
                return events, False
            if events[-1] == "[DONE]":
                rest = await resp.content.read()  # nothing may follow [DONE]
                if rest.strip():
                    events.append(rest.decode("utf-8", "replace"))
                return events, True
    except aiohttp.ClientPayloadError:
        pass
    return events, False
