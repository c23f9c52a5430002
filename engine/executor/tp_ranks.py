"""Tensor-parallel ranks 1..N-1: what they run, and how rank 0 starts and stops them.

Rank 0 is the engine's own process. ``RankGroup.start`` opens the rendezvous store (a file in a
private folder: the ranks share a node, and no port is opened), has a ``RankLauncher`` start the other ranks (``ProcessLauncher``: spawned processes for
the offline ``LLM``; the serving layer injects one that starts Ray actors), waits until each has
connected, then joins the group with them. Each other rank runs ``run_rank``: join the group,
load its shard, then run the steps rank 0 broadcasts until rank 0 sends the exit message.

Stopping: ``stop_ranks`` (from ``LLMEngine.shutdown``) sends the exit message (unless a step
broke off half-way) and calls ``RankGroup.stop``, which waits for the ranks and kills any that linger. Spawned processes
are daemons, are stopped by an ``atexit`` hook, ignore Ctrl-C (rank 0 handles it and stops
them) and exit on their own when rank 0's process dies (a thread watches it).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.config import EngineConfig
from engine.distributed import (
    Rendezvous,
    check_tp_sizes,
    destroy_tp_group,
    init_tp_group,
    open_store,
    tp_size,
)

if TYPE_CHECKING:
    from engine.executor.model_runner import ModelRunner
    from engine.models.hf_config import HFConfig

START_TIMEOUT_S = 600.0  # for every rank to connect (Ray may first have to place the actors)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank other than 0 needs; rank 0 resolves the settings once for all."""

    rank: int
    world_size: int
    store_path: str  # the rendezvous file (``engine.distributed.Rendezvous``)
    config: EngineConfig
    model_path: str
    dtype: str  # torch dtype name, e.g. "float32"
    max_model_len: int
    device: str = "cpu"  # "cpu", "cuda" (the one device Ray made visible) or "cuda:<i>"


def run_rank(spec: RankSpec) -> None:
    """A rank's whole life: connect, join the group, load this rank's shard, serve steps."""
    from engine.executor.model_runner import ModelRunner
    from engine.models.hf_config import HFConfig

    device = torch.device(spec.device)
    if device.type == "cpu":
        torch.set_num_threads(spec.config.device.cpu_threads(share=spec.world_size))
    store = open_store(spec.store_path, spec.world_size)
    store.set(f"rank{spec.rank}", "up")
    init_tp_group(store, spec.rank, spec.world_size, device)
    try:
        hf = HFConfig.load(spec.model_path)
        runner = ModelRunner(spec.config, hf, spec.model_path, device,
                             getattr(torch, spec.dtype), spec.max_model_len, progress=False)
        runner.serve_steps()
    finally:
        destroy_tp_group()


class RankLauncher(Protocol):
    """Starts ranks 1..N-1 on this node (they open ``spec.store_path``); the serving layer's
    starts Ray actors in the replica's placement group."""

    def rank_device(self, rank: int, world_size: int, device: torch.device) -> str:
        """The device ``rank`` uses, as it names it (``ValueError`` when there is none)."""

    def launch(self, specs: list[RankSpec]) -> None: ...

    def check(self) -> None:
        """Raise ``RuntimeError`` naming a rank that has stopped."""

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the ranks to exit, then kill what is left."""


class RankGroup:
    """Rank 0's handle on the group: the store, the launcher, and how to stop them."""

    def __init__(self, launcher: RankLauncher, rendezvous: Rendezvous,
                 store: torch.distributed.Store) -> None:
        self.launcher, self.rendezvous = launcher, rendezvous
        self.store: torch.distributed.Store | None = store  # None once stopped

    @classmethod
    def start(cls, launcher: RankLauncher, world_size: int, device: torch.device,
              **spec_fields: Any) -> RankGroup:
        """Start ranks 1..``world_size``-1 and join the group as rank 0."""
        devices = [launcher.rank_device(r, world_size, device) for r in range(1, world_size)]
        rendezvous = Rendezvous()  # ranks share a node (STRICT_PACK, or local processes)
        store = open_store(rendezvous.path, world_size)
        group = cls(launcher, rendezvous, store)
        try:
            launcher.launch([RankSpec(r, world_size, rendezvous.path, device=d, **spec_fields)
                             for r, d in enumerate(devices, start=1)])
            group._wait_connected(store, world_size)
            init_tp_group(store, 0, world_size, device)
        except BaseException:
            group.stop(timeout_s=0)
            raise
        return group

    def _wait_connected(self, store: torch.distributed.Store, world_size: int) -> None:
        keys = [f"rank{r}" for r in range(1, world_size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            self.launcher.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not start within "
                                   f"{START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)

    def check(self) -> None:
        self.launcher.check()

    def stop(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the ranks (after the exit message; 0 without it), kill
        any still running, leave the group."""
        self.launcher.stop(timeout_s)
        destroy_tp_group()
        self.store = None
        self.rendezvous.close()


def check_tp_start(world_size: int, hf: HFConfig) -> None:
    """Before anything loads: the model divides over ``world_size`` ranks, and no other
    tensor-parallel engine runs in this process (``ValueError`` / ``RuntimeError``)."""
    if world_size > 1:
        check_tp_sizes(world_size, num_heads=hf.num_heads, num_kv_heads=hf.num_kv_heads,
                       vocab_size=hf.vocab_size, intermediate_size=hf.intermediate_size)
    elif tp_size() != 1:
        raise RuntimeError("a tensor-parallel engine runs in this process; shut it down "
                           "before starting another engine here (one per process)")


def start_ranks(launcher: RankLauncher | None, config: EngineConfig, device: torch.device,
                model_path: str, dtype: torch.dtype, max_model_len: int) -> RankGroup:
    """Start ranks 1..N-1 (default launcher: local processes) and join them as rank 0."""
    return RankGroup.start(
        launcher or ProcessLauncher(), config.parallel.tensor_parallel_size, device,
        config=config, model_path=model_path, dtype=str(dtype).removeprefix("torch."),
        max_model_len=max_model_len)


def stop_ranks(ranks: RankGroup, runner: ModelRunner | None, send_exit: bool) -> None:
    """Rank 0: tell the ranks to exit when they can still hear it (``send_exit``, and no step
    broke off half-way), else kill them; leave the group."""
    told = send_exit and runner is not None and not runner.tp_broken
    if told:
        assert runner is not None
        try:
            runner.send_exit()
        except Exception:  # a rank is already gone: stop() kills the rest
            told = False
    ranks.stop(timeout_s=30.0 if told else 0.0)


class ProcessLauncher:
    """Ranks as spawned daemon processes on this machine (rank ``r`` on ``cuda:r``)."""

    def __init__(self) -> None:
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def rank_device(self, rank: int, world_size: int, device: torch.device) -> str:
        if device.type != "cuda":
            return device.type
        check_device_count(world_size, torch.cuda.device_count())
        return f"cuda:{rank}"

    def launch(self, specs: list[RankSpec]) -> None:
        ctx = multiprocessing.get_context("spawn")
        for spec in specs:
            proc = ctx.Process(target=_process_main, args=(spec,), daemon=True,
                               name=f"pagedserve-tp-rank{spec.rank}")
            proc.start()
            self.procs.append(proc)
        atexit.register(self.stop, 0.0)

    def check(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) has exited "
                                   f"with code {proc.exitcode}")

    def stop(self, timeout_s: float) -> None:
        atexit.unregister(self.stop)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.procs = []


def check_device_count(world_size: int, visible: int) -> None:
    if visible < world_size:
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} CUDA devices "
                         f"(one per rank), but {visible} are visible")


def _process_main(spec: RankSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    run_rank(spec)


def _exit_with_parent() -> None:
    """Rank 0's process died without stopping us (SIGKILL, SIGTERM): exit too."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child: no parent to watch
        return
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(1)

