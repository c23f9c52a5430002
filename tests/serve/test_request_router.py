"""``WorkerRequestRouter`` without a Ray cluster: least loaded, prefix affinity, control calls to
the replica they name, a retried batch kept away from its dead replica, and a replica whose
engine stopped (stalled) ranked last."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from serve_app.cluster.request_router import WorkerRequestRouter, prefix_hashes


def _router(**kwargs) -> WorkerRequestRouter:
    r = WorkerRequestRouter(deployment_id=DeploymentID(name="WorkerTest", app_name="t"),
                            handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**{"prefix_chunk_tokens": 4, "prefix_min_match_tokens": 8,
                          "imbalance_threshold": 4, **kwargs})
    return r


def _replica(uid: str, running: int = 0, waiting: int = 0, free: int = 100):
    return SimpleNamespace(
        replica_id=ReplicaID(uid, DeploymentID(name="WorkerTest", app_name="t")),
        routing_stats={"num_running": running, "num_waiting": waiting, "num_free_blocks": free,
                       "num_total_blocks": 100},
        max_ongoing_requests=100)


def _pending(**kwargs):
    return SimpleNamespace(args=[], kwargs=kwargs, routing_context=SimpleNamespace())


def _choose(router, replicas, pending):
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def test_least_loaded_by_queue_then_free_blocks():
    router = _router()
    a, b, c = _replica("a", running=4, waiting=2), _replica("b", running=3), \
        _replica("c", running=3, free=10)
    assert _choose(router, [a, b, c], _pending(requests=[1])) == ["b", "c", "a"]


def test_control_call_goes_to_the_named_replica():
    router = _router()
    a, b = _replica("a"), _replica("b", running=50)
    assert _choose(router, [a, b], _pending(request_ids=["r"], target_replica="b")) == ["b"]


def test_sent_batches_count_until_a_report_has_received_them():
    router = _router()
    a, b = _replica("a"), _replica("b", running=1)
    router.on_request_routed(_pending(requests=[1, 2, 3], stream_key="k"), a.replica_id, None)
    assert router.load(a) == 3
    assert _choose(router, [a, b], _pending(requests=[1])) == ["b", "a"]
    # a report taken while the batch was in transit (after it was sent, without it) counts it
    a.routing_stats.update(received={"k": 0})
    assert router.load(a) == 3
    # another Router's requests at the replica do not cover ours
    a.routing_stats.update(received={"other": 3, "k": 1}, num_running=1)
    assert router.load(a) == 1 + 2
    a.routing_stats.update(received={"k": 3}, num_running=0)  # received, and done
    assert router.load(a) == 0
    assert _choose(router, [a, b], _pending(requests=[1])) == ["a", "b"]


def test_prefix_affinity_unless_much_busier():
    router = _router()
    a, b = _replica("a"), _replica("b")
    prompt = list(range(40))
    hashes = [prefix_hashes(prompt, 4)]
    router.on_request_routed(_pending(requests=[1], prefix_hashes=hashes, stream_key="k"),
                             b.replica_id, None)
    b.routing_stats["received"] = {"k": 1}
    a.routing_stats["num_running"] = 1  # b would win on load alone anyway: make a lighter
    b.routing_stats["num_running"] = 3
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=hashes))[0] == "b"
    other = [prefix_hashes(list(range(100, 140)), 4)]
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=other))[0] == "a"
    b.routing_stats["num_running"] = 10  # much busier than a (threshold 4)
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=hashes))[0] == "a"


def test_prefix_hashes_are_chained_and_skip_the_last_token():
    assert len(prefix_hashes(list(range(9)), 4)) == 2
    assert len(prefix_hashes(list(range(8)), 4)) == 1  # the last token is never covered
    x, y = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert x[1] != y[1]  # a different first chunk changes every later hash


def test_a_retried_batch_never_goes_back_to_the_dead_replica():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

    from serve_app.cluster.request_router import WorkerRequestRouter

    dep = DeploymentID(name="WorkerHardening", app_name="t")
    router = WorkerRequestRouter(deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state()

    def replica(uid: str, running: int):
        return SimpleNamespace(replica_id=ReplicaID(uid, dep), max_ongoing_requests=100,
                               routing_stats={"num_running": running, "num_waiting": 0,
                                              "num_free_blocks": 10, "num_total_blocks": 10})

    def choose(replicas, **kwargs):
        pending = SimpleNamespace(args=[], kwargs=kwargs, routing_context=SimpleNamespace())
        ranks = asyncio.run(router.choose_replicas(replicas, pending))
        return [r.replica_id.unique_id for rank in ranks for r in rank]

    dead, busy = replica("dead", 0), replica("busy", 9)
    assert choose([dead, busy], requests=[1]) == ["dead", "busy"]  # least loaded first
    assert choose([dead, busy], requests=[1], avoid_replica="dead") == ["busy"]
    assert choose([dead], requests=[1], avoid_replica="dead") == []  # wait for another one


def test_a_replica_whose_engine_stopped_comes_last_and_loses_its_prefix_affinity():
    """A stalled engine (``step_timeout_s``) answers 503 until Serve replaces its replica:
    batches go to the others first, even a batch whose prefix it holds; alone, it still gets
    them (a fast 503, not a wait)."""
    router = _router()
    a, b = _replica("a", running=2), _replica("b")
    hashes = [prefix_hashes(list(range(20)), 4)]
    router.on_request_routed(_pending(requests=[1], prefix_hashes=hashes), a.replica_id, None)
    a.routing_stats["received"] = {"": 1}
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=hashes)) == ["a", "b"]
    a.routing_stats["stopped"] = True
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=hashes)) == ["b", "a"]
    a.routing_stats["num_running"], b.routing_stats["num_running"] = 0, 3  # a: less loaded
    assert _choose(router, [a, b], _pending(requests=[1])) == ["b", "a"]
    assert _choose(router, [a], _pending(requests=[1])) == ["a"]
