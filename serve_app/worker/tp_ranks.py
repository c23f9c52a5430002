"""Tensor-parallel ranks 1..N-1 of a Worker replica, as Ray actors in its placement group.

Serve reserves one bundle per rank for every Worker replica (``placement_group_bundles`` with
``STRICT_PACK``, so all of a replica's ranks share a node); the replica itself is rank 0 in
bundle 0 and ``RayRankLauncher`` places rank ``r`` in bundle ``r``. Each actor spends its life
in one call, ``RankActor.run`` (``engine.executor.tp_ranks.run_rank``); the call's reference resolves
when the rank exits or its actor dies, which ``check`` sees without blocking. The replica owns
the actors, so they die with it; ``stop`` kills them when the engine shuts down.
"""

from __future__ import annotations

from typing import Any

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from engine import RankSpec


class RankActor:
    """One rank other than 0: joins the group, loads its shard, runs steps until told to exit."""

    @ray.method  # no options: only types ``run.remote`` for mypy
    def run(self, spec: RankSpec) -> None:
        from engine import run_rank

        run_rank(spec)


# ray.remote called rather than used as a class decorator, which mypy cannot see through: this
# is an ActorClass[RankActor] to the type checker too (Ray's "Type hints in Ray", pattern 1)
RANK_ACTOR = ray.remote(max_restarts=0)(RankActor)


class RayRankLauncher:
    """``engine.executor.tp_ranks.RankLauncher`` for a Serve replica (or any Ray actor or driver)."""

    def __init__(self, name_prefix: str, num_cpus: float, num_gpus: float) -> None:
        self.name_prefix, self.num_cpus, self.num_gpus = name_prefix, num_cpus, num_gpus
        self.actors: list[Any] = []  # handles (Ray types them ActorHandle | type[RankActor])
        self.refs: list[ray.ObjectRef[None]] = []  # each rank's run(): resolves when it ends

    def rank_device(self, rank: int, world_size: int, device: torch.device) -> str:
        return "cuda" if device.type == "cuda" else "cpu"  # Ray shows each actor its own GPU

    def launch(self, specs: list[RankSpec]) -> None:
        pg = get_current_placement_group()
        world_size = len(specs) + 1
        if pg is not None and pg.bundle_count < world_size:
            raise ValueError(f"tensor_parallel_size={world_size} needs a placement group of "
                             f"{world_size} bundles (one per rank); this one has "
                             f"{pg.bundle_count}")
        for spec in specs:
            where: PlacementGroupSchedulingStrategy | NodeAffinitySchedulingStrategy
            if pg is not None:
                where = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=spec.rank)
            else:  # no placement group: stay on this node, ranks talk over loopback
                where = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                       soft=False)
            actor = RANK_ACTOR.options(name=f"{self.name_prefix}-rank{spec.rank}",
                                       num_cpus=self.num_cpus, num_gpus=self.num_gpus,
                                       scheduling_strategy=where).remote()
            self.actors.append(actor)
            self.refs.append(actor.run.remote(spec))

    def check(self) -> None:
        if not self.refs:
            return
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in ready:
            rank = self.refs.index(ref) + 1
            try:
                ray.get(ref)
                reason = "it exited"
            except Exception as e:  # RayActorError when killed, or the rank's own error
                reason = f"{type(e).__name__}: {e}"
            raise RuntimeError(f"tensor-parallel rank {rank} has stopped ({reason})")

    def stop(self, timeout_s: float) -> None:
        if self.refs and timeout_s > 0:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors, self.refs = [], []
