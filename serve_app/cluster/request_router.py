"""``WorkerRequestRouter``: Serve request router for the Worker deployment (Ray 2.60 API).

It runs inside each Router replica's deployment handle and picks a Worker replica per handle
call:

* **Control calls** (``abort``, ``get_stats``, ``model_info``) that pass ``target_replica=<id>``
  go to that replica and nowhere else: an abort must reach the engine that holds the request.
* **Batches** (``generate_batch(requests=..., prefix_hashes=...)``) go to the least loaded
  replica, unless one replica already holds a long prefix of the batch's prompts in its cache
  (*prefix affinity*) and is not much busier (``imbalance_threshold``). A batch retried after
  its replica died (``avoid_replica=<id>``) never goes back to that replica; with no other one
  it waits for Serve to start one.

Load of a replica = its last reported running + waiting requests (``record_routing_stats``,
every ``routing_stats_period_s``) plus the requests this handle sent it that the report had not
received yet: the Worker reports how many requests it has received per ``stream_key`` (one per
Router), and the handle counts what it sent per replica and key, so a report taken while a batch
is still in transit never hides it (clocks play no part). Serve's ``on_request_completed`` is
not used because in Ray 2.60 it fires as soon as a *streaming* call's first message arrives.
Ties go to the replica with more free KV blocks. A replica whose engine has stalled or stopped
(its report's ``stopped``) comes last and gets no prefix affinity: until Serve replaces it, it
only answers 503. Prefix ownership is what this handle has sent where: chained hashes of
``prefix_chunk_tokens``-token prompt chunks, kept in an LRU.

**Standby replicas** (``standby_replicas`` N > 0, the autoscaling policy's setting): Workers
started and loaded but sent no batch, so that a burst finds capacity already warm. Live replicas
are ordered by when this handle first saw them; walking from the youngest, the first N that
hold no request (reported or in transit) are standby. A batch goes to a standby replica only
when every active replica is full: its queue (waiting + in transit) is at least
``target_queue_per_replica``, its KV-cache usage at least ``max_kv_usage``, or its engine has
stopped. That batch promotes it (it then holds requests, so it is active: one routing decision,
no start) and the next-youngest idle replica, if any, becomes standby; the policy, which counts
standby replicas in its answer, sees the load and starts a replacement. Each Router's handle
applies the rule on its own view.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serve_app.cluster import registry

if TYPE_CHECKING:  # the wire module imports the engine's (and torch); this one stays light
    from serve_app.wire import RoutingStats

_MAX_PREFIX_ENTRIES = 200_000


class WorkerRequestRouter(RequestRouter):
    """Least loaded by reported queue depth and free KV blocks, with prefix affinity."""

    def initialize_state(self, prefix_chunk_tokens: int = 32, prefix_min_match_tokens: int = 64,
                         imbalance_threshold: int = 16, standby_replicas: int = 0,
                         target_queue_per_replica: float = 4.0, max_kv_usage: float = 0.9,
                         **_: Any) -> None:
        self._standby = standby_replicas
        self._full_queue, self._full_kv = target_queue_per_replica, max_kv_usage
        self._seen: dict[str, int] = {}  # replica id -> order in which this handle first saw it
        self._seen_count = 0
        self._chunk = prefix_chunk_tokens
        self._min_match = prefix_min_match_tokens
        self._imbalance = imbalance_threshold
        self._owners: OrderedDict[int, set[str]] = OrderedDict()  # prefix hash -> replica ids
        self._sent: dict[str, dict[str, int]] = {}  # replica -> stream_key -> requests sent
        registry.register(self._deployment_id.name, self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when all are full
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        target = kwargs.get("target_replica")
        if target is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
        avoid = kwargs.get("avoid_replica")
        if avoid is not None:
            candidate_replicas = [r for r in candidate_replicas
                                  if r.replica_id.unique_id != avoid]
            if not candidate_replicas:
                return []
        active, standby = self._split_standby(candidate_replicas)
        ranked = sorted(active, key=self._load_key)
        best = self._affine_replica(ranked, kwargs.get("prefix_hashes"))
        if best is not None:
            ranked.remove(best)
            ranked.insert(0, best)
        if standby and all(self._full(r) for r in active):
            return [[r] for r in standby + ranked]  # promote the oldest standby replica
        return [[r] for r in ranked]

    # ---- standby replicas ------------------------------------------------------------------

    def _split_standby(self, replicas: list[RunningReplica],
                       ) -> tuple[list[RunningReplica], list[RunningReplica]]:
        """(active, standby): standby are the youngest ``standby_replicas`` that hold no
        request, oldest first; all are active with the setting at 0."""
        if self._standby <= 0:
            return replicas, []
        live = {r.replica_id.unique_id for r in replicas}
        for rid in sorted(live - self._seen.keys()):  # seen together: by id, for determinism
            self._seen[rid] = self._seen_count
            self._seen_count += 1
        if len(self._seen) > len(live):
            self._seen = {rid: n for rid, n in self._seen.items() if rid in live}
        standby: list[RunningReplica] = []
        for r in sorted(replicas, key=lambda r: -self._seen[r.replica_id.unique_id]):
            if len(standby) == self._standby:
                break
            if self.load(r) == 0 and not _stats(r).get("stopped", False):
                standby.insert(0, r)
        return [r for r in replicas if r not in standby], standby

    def _full(self, replica: RunningReplica) -> bool:
        """No room: its queue or its KV-cache usage at the autoscaling bounds, or stopped."""
        stats = _stats(replica)
        total = stats.get("num_total_blocks") or 1
        usage = 1.0 - stats.get("num_free_blocks", total) / total
        queue = self.load(replica) - int(stats.get("num_running", 0))
        return (queue >= self._full_queue or usage >= self._full_kv
                or bool(stats.get("stopped", False)))

    # ---- load ------------------------------------------------------------------------------

    def load(self, replica: RunningReplica) -> int:
        """Reported running + waiting, plus what was sent that the report had not received."""
        stats = _stats(replica)
        received = stats.get("received") or {}
        sent = self._sent.get(replica.replica_id.unique_id, {})
        in_transit = sum(max(0, n - received.get(key, 0)) for key, n in sent.items())
        return int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0)) + in_transit

    def _load_key(self, replica: RunningReplica) -> tuple[bool, int, float]:
        stats = _stats(replica)
        total = stats.get("num_total_blocks") or 1
        return (stats.get("stopped", False), self.load(replica),
                -stats.get("num_free_blocks", total) / total)

    # ---- prefix affinity -------------------------------------------------------------------

    def _affine_replica(self, ranked: list[RunningReplica],
                        prefix_hashes: list[list[int]] | None) -> RunningReplica | None:
        if not prefix_hashes or len(ranked) < 2:
            return None
        by_id = {r.replica_id.unique_id: r for r in ranked if not _stats(r).get("stopped")}
        matched: dict[str, int] = {}
        for hashes in prefix_hashes:
            for rid, depth in self._match(hashes).items():
                matched[rid] = matched.get(rid, 0) + depth * self._chunk
        candidates = [(tokens, rid) for rid, tokens in matched.items() if rid in by_id]
        if not candidates:
            return None
        tokens, rid = max(candidates)
        if tokens < max(self._min_match, 1):
            return None
        best = by_id[rid]
        if self.load(best) > self.load(ranked[0]) + self._imbalance:
            return None  # much busier than the least loaded replica
        return best

    def _match(self, hashes: list[int]) -> dict[str, int]:
        """Per replica, how many leading chunks of this prompt it has been sent."""
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            owners = self._owners.get(h)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for rid in alive:
                depth[rid] = i + 1
        return depth

    def _remember(self, hashes_per_request: list[list[int]], rid: str) -> None:
        owners = self._owners
        for hashes in hashes_per_request:
            for h in hashes:
                entry = owners.get(h)
                if entry is None:
                    owners[h] = {rid}
                else:
                    entry.add(rid)
                    owners.move_to_end(h)
        while len(owners) > _MAX_PREFIX_ENTRIES:
            owners.popitem(last=False)

    # ---- lifecycle hooks -------------------------------------------------------------------

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        kwargs = pending_request.kwargs
        if "requests" not in kwargs:
            return  # a control call
        rid = replica_id.unique_id
        sent = self._sent.setdefault(rid, {})
        key = kwargs.get("stream_key") or ""
        sent[key] = sent.get(key, 0) + len(kwargs["requests"])
        if kwargs.get("prefix_hashes"):
            self._remember(kwargs["prefix_hashes"], rid)


def _stats(replica: RunningReplica) -> RoutingStats:
    """The replica's last ``Worker.record_routing_stats`` (empty before its first report: read
    it with defaults)."""
    return cast("RoutingStats", replica.routing_stats or {})


def prefix_hashes(token_ids: list[int], chunk: int) -> list[int]:
    """Chained hashes of the prompt's full ``chunk``-token chunks, last token excluded."""
    out: list[int] = []
    h = 0
    usable = (len(token_ids) - 1) // chunk * chunk
    for start in range(0, usable, chunk):
        h = hash((h, tuple(token_ids[start : start + chunk])))
        out.append(h)
    return out
