"""Standby Workers in ``WorkerRequestRouter`` (#53), without a Ray cluster: the youngest idle
replicas (in the order this handle first saw them) get no batch while an active replica has
room; a batch that finds every active replica full goes to the standby one, which then holds
requests and is active, and the next-youngest idle replica is standby in its place. Control
calls reach any replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from serve_app.cluster.request_router import WorkerRequestRouter

DEPLOYMENT = DeploymentID(name="WorkerStandbyTest", app_name="t")


def _router(standby: int = 1) -> WorkerRequestRouter:
    r = WorkerRequestRouter(deployment_id=DEPLOYMENT,
                            handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(standby_replicas=standby, target_queue_per_replica=2, max_kv_usage=0.8)
    return r


def _replica(uid: str, running: int = 0, waiting: int = 0, free: int = 100):
    return SimpleNamespace(
        replica_id=ReplicaID(uid, DEPLOYMENT),
        routing_stats={"num_running": running, "num_waiting": waiting, "num_free_blocks": free,
                       "num_total_blocks": 100},
        max_ongoing_requests=100)


def _pending(**kwargs):
    return SimpleNamespace(args=[], kwargs=kwargs, routing_context=SimpleNamespace())


def _choose(router, replicas, **kwargs) -> list[str]:
    ranks = asyncio.run(router.choose_replicas(replicas, _pending(**kwargs)))
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def _route(router, replica, n: int = 1) -> None:
    """What the handle does once the batch is accepted: count it as sent to ``replica``."""
    router.on_request_routed(_pending(requests=[0] * n, stream_key="k"), replica.replica_id,
                             None)


def test_standby_gets_no_batch_while_an_active_replica_has_room():
    router = _router()
    old = _replica("old", running=3, waiting=1)  # queue 1 < 2, KV 0% < 80%: room
    assert _choose(router, [old], requests=[1]) == ["old"]  # seen first: active
    young = _replica("young")  # idle and seen later: standby
    assert _choose(router, [old, young], requests=[1]) == ["old"]
    assert _choose(router, [young, old], requests=[1]) == ["old"]  # list order plays no part


def test_standby_gets_the_batch_when_every_active_replica_is_full():
    router = _router()
    a, b = _replica("a", running=4, waiting=2), _replica("b", running=2, free=10)
    assert _choose(router, [a, b], requests=[1]) == ["b", "a"]  # both busy: no standby yet
    s = _replica("s")
    # a: queue 2 >= 2; b: KV 90% >= 80%: both full, so the standby one comes first
    assert _choose(router, [a, b, s], requests=[1]) == ["s", "b", "a"]
    b.routing_stats["num_free_blocks"] = 50  # b has room again: s is kept back
    assert _choose(router, [a, b, s], requests=[1]) == ["b", "a"]


def test_a_promoted_replica_is_active_and_the_next_youngest_idle_one_is_standby():
    router = _router()
    a = _replica("a", running=4, waiting=2)
    assert _choose(router, [a], requests=[1]) == ["a"]
    s1 = _replica("s1")
    assert _choose(router, [a, s1], requests=[1]) == ["s1", "a"]
    _route(router, s1, 1)  # promoted: it holds requests (in transit, not yet reported)
    s2 = _replica("s2")  # the policy's replacement
    assert _choose(router, [a, s1, s2], requests=[1]) == ["s1", "a"]  # s1 has room: s2 waits
    s1.routing_stats.update(received={"k": 1}, num_waiting=2, num_running=1)
    assert _choose(router, [a, s1, s2], requests=[1]) == ["s2", "s1", "a"]  # all full
    # load gone everywhere: the youngest idle one (s2) is the standby, the others active
    for r in (a, s1):
        r.routing_stats.update(num_running=0, num_waiting=0)
    assert _choose(router, [a, s1, s2], requests=[1]) == ["a", "s1"]


def test_a_stopped_active_replica_counts_as_full():
    router = _router()
    a = _replica("a")
    assert _choose(router, [a], requests=[1]) == ["a"]
    a.routing_stats["stopped"] = True
    s = _replica("s")
    assert _choose(router, [a, s], requests=[1]) == ["s", "a"]


def test_control_calls_reach_a_standby_replica():
    router = _router()
    a, s = _replica("a"), _replica("s")
    assert _choose(router, [a], requests=[1]) == ["a"]
    assert _choose(router, [a, s], requests=[1]) == ["a"]
    assert _choose(router, [a, s], request_ids=["r"], target_replica="s") == ["s"]


def test_a_lone_replica_is_never_held_back():
    router = _router()
    only = _replica("only")  # idle, and the youngest: standby, but no active one has room
    assert _choose(router, [only], requests=[1]) == ["only"]


def test_without_standby_every_replica_is_ranked():
    router = _router(standby=0)
    a, s = _replica("a", running=1), _replica("s")
    assert _choose(router, [a], requests=[1]) == ["a"]
    assert _choose(router, [a, s], requests=[1]) == ["s", "a"]


def test_the_app_passes_the_policy_settings_to_the_request_router():
    from serve_app.app import worker_options
    from serve_app.config import AppConfig

    cfg = AppConfig.model_validate({"autoscaling": {
        "max_replicas": 3, "standby_replicas": 1, "target_queue_per_replica": 3,
        "max_kv_usage": 0.7}})
    kwargs = worker_options(cfg)["request_router_config"].request_router_kwargs
    assert {k: kwargs[k] for k in ("standby_replicas", "target_queue_per_replica",
                                   "max_kv_usage")} == {"standby_replicas": 1,
                                                        "target_queue_per_replica": 3,
                                                        "max_kv_usage": 0.7}
    fixed = worker_options(AppConfig.model_validate({"num_workers": 2}))
    assert "standby_replicas" not in fixed["request_router_config"].request_router_kwargs
