"""Tensor-parallel process groups and collectives.

With one rank (the default) no group exists and every collective is the identity, so layers are
written tensor-parallel-ready and still run as plain layers. With N ranks, all join one
``torch.distributed`` group (NCCL on CUDA, gloo on the CPU) through a rendezvous ``FileStore``:
a file in a folder of rank 0's that only its user can open. The ranks of one engine always share
a node, so no rendezvous port is opened at all, and the groups' own sockets (gloo's pairs, NCCL's
bootstrap) are bound to the loopback interface (``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` set to ``lo`` in each rank's process): nothing the group opens can be
reached from another machine. Step metadata always travels over gloo (a CPU group of its
own next to NCCL), so ranks idle between steps without NCCL's watchdog firing. One group per
process: a process runs at most one tensor-parallel engine at a time.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

# Ranks 1..N-1 wait for the next step for as long as the engine idles; a dead peer still fails
# a collective at once (its sockets close), so this bound only covers a peer that hangs.
IDLE_TIMEOUT = timedelta(days=365)
STORE_TIMEOUT = timedelta(minutes=10)
LOOPBACK_INTERFACE = "lo"
SOCKET_INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

logger = logging.getLogger(__name__)

_cpu_group: dist.ProcessGroup | None = None


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each rank's ``x`` along the last dimension on rank 0 (None elsewhere)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's ``value`` (on the device group, so NCCL starts here)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_cpu(t: torch.Tensor) -> None:
    """Broadcast a CPU tensor from rank 0 into ``t`` on every rank, over gloo."""
    dist.broadcast(t, src=0, group=_cpu_group)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator


def check_tp_sizes(tp: int, *, num_heads: int, num_kv_heads: int, vocab_size: int,
                   intermediate_size: int) -> None:
    """``ValueError`` naming the numbers when a model cannot be split ``tp`` ways."""
    divide(num_heads, tp, "num_attention_heads")
    divide(vocab_size, tp, "vocab_size")
    divide(intermediate_size, tp, "intermediate_size")
    if num_kv_heads >= tp:
        divide(num_kv_heads, tp, "num_key_value_heads")
    elif tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({tp}) is not a multiple of "
                         f"num_key_value_heads ({num_kv_heads}), so KV heads cannot be replicated")


class Rendezvous:
    """Rank 0's rendezvous folder (mode 0700): ``path`` names the store's file, which every
    rank opens with ``open_store``; ``close`` removes the folder."""

    def __init__(self) -> None:
        self.folder: str | None = tempfile.mkdtemp(prefix="pagedserve-tp-")
        self.path = os.path.join(self.folder, "store")

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def open_store(path: str, world_size: int) -> dist.FileStore:
    """The rendezvous store every rank of a group opens (``Rendezvous.path``)."""
    store = dist.FileStore(path, world_size)
    store.set_timeout(STORE_TIMEOUT)
    return store


def bind_to_loopback() -> None:
    """Gloo and NCCL open their sockets on the loopback interface in this process: the ranks
    of one engine share a node, and nothing else may reach them. Replaces a value set before
    (logged): a multi-node setting has no use here."""
    for name in SOCKET_INTERFACE_VARS:
        if os.environ.get(name, LOOPBACK_INTERFACE) != LOOPBACK_INTERFACE:
            logger.warning("%s=%s replaced by %s: the ranks of a tensor-parallel engine share "
                           "a node and talk over loopback only", name, os.environ[name],
                           LOOPBACK_INTERFACE)
        os.environ[name] = LOOPBACK_INTERFACE


def init_tp_group(store: dist.Store, rank: int, world_size: int, device: torch.device) -> None:
    """Join the tensor-parallel group (all ranks call this with the same store)."""
    global _cpu_group
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group is already initialised in this process; "
                           "one tensor-parallel engine per process (shut the other down first)")
    bind_to_loopback()
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                device_id=device)
        _cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=IDLE_TIMEOUT)
        _cpu_group = dist.group.WORLD


def destroy_tp_group() -> None:
    global _cpu_group
    _cpu_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
