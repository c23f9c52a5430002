"""The fault driver: injects the soak's faults into a ``LocalApp`` and times each recovery.

A fault ends when the replicas have settled at their target count, the Routers see that many
Workers, and a probe request completes; ``Fault.end`` stays None when that did not happen
within ``RECOVERY_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .cluster import RECOVERY_TIMEOUT_S, LocalApp, wait_for
from .report import Fault
from .runner import Runner


class Faults:
    """Injects the faults into a ``LocalApp`` and times the recovery from each."""

    def __init__(self, app: LocalApp, runner: Runner, session: aiohttp.ClientSession) -> None:
        self.app, self.runner, self.session = app, runner, session
        self.log: list[Fault] = []

    async def run(self, names: list[str], at: list[float]) -> None:
        """Each fault in turn, the k-th not before ``at[k]`` seconds into the run."""
        for name, when in zip(names, at):
            await asyncio.sleep(max(0.0, when - self.runner.now()))
            if name == "scale_down":
                await self.scale(name, 1)
                await self.scale("scale_up", 2)
            else:
                await self.kill(name)

    async def kill(self, name: str) -> None:
        deployment = "Worker" if name == "worker_kill" else "Router"
        target = self.app.num_workers if deployment == "Worker" else self.app.cfg.num_routers
        fault = Fault(name, self.runner.now())
        self.log.append(fault)
        busiest = None
        if deployment == "Worker":  # the one with the most requests: the kill hits work
            workers = (await self.runner.stats(self.session)).get("workers", [])
            if workers:
                top = max(workers, key=lambda w: w["num_running"] + w["num_waiting"])
                busiest = top["replica"]
                fault.detail["requests_on_it"] = top["num_running"] + top["num_waiting"]
        replica, pid = await asyncio.to_thread(self.app.kill, deployment, busiest)
        fault.detail.update(replica=replica, pid=pid)
        await self._recover(fault, deployment, target, pid)

    async def scale(self, name: str, num_workers: int) -> None:
        fault = Fault(name, self.runner.now(), detail={"workers": num_workers})
        self.log.append(fault)
        await asyncio.to_thread(self.app.scale, num_workers)
        await self._recover(fault, "Worker", num_workers, None)

    async def _recover(self, fault: Fault, deployment: str, target: int, gone: int | None) -> None:
        took = await asyncio.to_thread(wait_for, lambda: self.app.settled(deployment, target, gone),
                                       RECOVERY_TIMEOUT_S)
        if took is None:
            fault.detail["error"] = f"{deployment} replicas did not settle at {target}"
            return
        if deployment == "Worker":  # the Routers see the new set of Workers
            deadline = self.runner.now() + RECOVERY_TIMEOUT_S
            while self.runner.now() < deadline:
                stats = await self.runner.stats(self.session)
                if len(stats.get("workers", [])) == target:
                    break
                await asyncio.sleep(0.5)
        ok, failed = await self.runner.probe_until_ok(self.session, RECOVERY_TIMEOUT_S)
        fault.detail["failed_probes"] = failed
        if ok:
            fault.end = self.runner.now()
