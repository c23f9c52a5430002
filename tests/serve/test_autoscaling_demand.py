"""``QueueDepthPolicy``'s demand rules on scripted metric sequences: the Routers' arrivals read
before any queue forms, a burst sized in one step for the backlog of a replica start, no
scale-down during a burst, flapping, a Worker lost mid-burst, standby replicas, the trend floor,
and the metrics read from a real ``AutoscalingContext``. No Ray cluster."""

from __future__ import annotations

import time

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.autoscaling.config import load_policy
from serve_app.autoscaling.policy import STATE_KEY, QueueDepthPolicy
from serve_app.autoscaling.signals import (
    DEMAND_ARRIVALS,
    DEMAND_WAITING,
    FINISHED_PER_S,
    KV_USAGE,
    RUNNING,
    WAITING,
    Load,
)

DEP = DeploymentID(name="Worker", app_name="app")
LOOK_BACK = 30.0


def new_policy(**kwargs) -> QueueDepthPolicy:
    """Loose queue rule (q = 100) so the demand rules decide; start 30 s; bound u = 0.8."""
    return QueueDepthPolicy(**{"target_queue_per_replica": 100, "max_kv_usage": 0.8,
                               "downscale_threshold": 0.5, "replica_start_s": 30.0, **kwargs})


def load(replicas: int, *, arrivals: float = 0.0, usage: float = 0.0, finished: float = 0.0,
         queue: float = 0.0, running: float = 0.0) -> Load:
    return Load(queue=queue, running=running, usage=usage, finished=finished,
                arrivals=arrivals, replicas=replicas, look_back_s=LOOK_BACK)


def learn(policy: QueueDepthPolicy, current: int = 1) -> None:
    """One replica 30% full finishing 1.5 requests/s: 5 requests/s per full replica."""
    base = load(current, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    assert policy.decide(base, base, base, current, 1, 0.0) == ("hold", current)
    assert policy.capacity.per_usage == pytest.approx(5.0)


def test_arrivals_at_the_routers_scale_up_before_any_queue_forms():
    policy = new_policy()
    learn(policy)
    # 6/s arrive; the replica has no queue yet and is still 30% full
    burst = load(1, arrivals=6.0, usage=0.3, finished=1.5, running=18)
    quiet = load(1, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    # rate rule ceil(6 / (5 * 0.8)) = 2; backlog rule: (6 - 1 * 5) * 30 s = 30 waiting when
    # the new replicas are up, cleared within 30 s more: ceil((6 + 30 / 30) / 5) = 2
    assert policy.decide(burst, burst, quiet, 1, 1, 1.0) == ("up", 2)
    # without the Routers' signal nothing would move: no queue, usage under the bound
    blind = load(1, usage=0.3, finished=1.5, running=18)
    assert new_policy().decide(blind, blind, blind, 1, 1, 1.0) == ("hold", 1)


def test_a_burst_is_sized_in_one_step_for_the_backlog_of_a_start():
    policy = new_policy()
    learn(policy)
    burst = load(1, arrivals=9.0, queue=40, usage=0.9, finished=4.5, running=54)
    # rate: ceil(9 / 4) = 3; backlog: 40 + (9 - 5) * 30 = 160 -> ceil((9 + 160 / 30) / 5) = 3
    assert policy.decide(burst, burst, load(1, arrivals=1.5), 1, 1, 1.0) == ("up", 3)
    shorter = new_policy(replica_start_s=5.0)
    learn(shorter)
    # 40 + 4 * 5 = 60 waiting, to clear within 5 s: ceil((9 + 12) / 5) = 5
    assert shorter.decide(burst, burst, load(1, arrivals=1.5), 1, 1, 1.0) == ("up", 5)


def test_nothing_scales_down_during_a_burst_and_one_window_after():
    policy = new_policy()
    learn(policy)
    calm = load(3, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    spike = load(3, arrivals=4.0, usage=0.3, finished=1.5, running=18)
    # the panic window's 4/s is over 2x the stable window's 1.5/s: hold, not down
    assert policy.decide(calm, spike, calm, 3, 1, 10.0) == ("hold", 3)
    assert policy.decide(calm, calm, calm, 3, 1, 10.0 + LOOK_BACK - 1) == ("hold", 3)
    # one stable window after the last burst signal: down to ceil(1.5 / (5 * 0.8 * 0.5)) = 1
    # for the rate and ceil(0.3 / 0.4) = 1 for the usage
    assert policy.decide(calm, calm, calm, 3, 1, 10.0 + LOOK_BACK + 1) == ("down", 1)
    # the answer a policy that never saw the spike gives at once
    fresh = new_policy()
    learn(fresh)
    assert fresh.decide(calm, calm, calm, 3, 1, 11.0) == ("down", 1)


def test_flapping_arrivals_never_take_replicas_down_and_up_again():
    policy = new_policy()
    learn(policy)
    current, answers = 2, []
    for tick in range(200):  # 0.5 s ticks; arrivals alternate 1/s and 5/s every 5 s
        rate = 5.0 if (tick // 10) % 2 else 1.0
        now_load = load(2, arrivals=rate, usage=0.4, finished=2.0, running=24)
        window = load(2, arrivals=3.0, usage=0.4, finished=2.0, running=24)
        decision, current = policy.decide(now_load, now_load, window, current, 1, 1.0 + tick / 2)
        answers.append(current)
    assert all(b >= a for a, b in zip(answers, answers[1:]))  # never down then up
    assert answers[-1] == 2  # 5/s needs ceil(5 / 4) = 2; nothing more


def test_a_worker_lost_mid_burst_is_not_read_as_idleness():
    policy = new_policy()
    learn(policy)
    # target 3; one replica died: 2 report, the load they carry is the whole fleet's
    survivors = load(2, arrivals=9.0, queue=10, usage=1.6, finished=8.0, running=96)
    decision, replicas = policy.decide(survivors, survivors, survivors, 3, 1, 5.0)
    assert (decision, replicas) == ("hold", 3)  # not down, though only 2 run
    growing = load(2, arrivals=12.0, queue=60, usage=1.6, finished=8.0, running=96)
    # rate ceil(12 / 4) = 3; backlog 60 + (12 - 2 * 5) * 30 = 120: ceil((12 + 4) / 5) = 4
    assert policy.decide(growing, growing, survivors, 3, 1, 6.0) == ("up", 4)


def test_standby_capacity_is_kept_while_traffic_is_bursty():
    policy = new_policy(standby_replicas=1)
    learn(policy)
    quiet = load(1, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    assert policy.decide(quiet, quiet, quiet, 1, 1, 1.0) == ("hold", 1)  # smooth: no standby
    # a burst, 6/s against a 1.5/s baseline: 2 replicas for it (rate ceil(6 / 4); backlog
    # (6 - 5) * 30 s cleared in 30 s more: ceil(7 / 5)), and one replica's worth of idle
    # capacity beside its 1.2 replicas at full usage: ceil(6 / 5 + 1) = 3
    burst = load(1, arrivals=6.0, usage=0.3, finished=1.5, running=18)
    assert policy.decide(burst, burst, quiet, 1, 1, 2.0) == ("up", 3)
    # after it, back to the quiet load: one active and the standby, ceil(0.3 + 1) = 2
    after = load(3, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    assert policy.decide(after, after, after, 3, 1, 100.0) == ("down", 2)
    two = load(2, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    assert policy.decide(two, two, two, 2, 1, 800.0) == ("hold", 2)
    # fifteen minutes after the last burst the traffic counts as smooth again
    assert policy.decide(two, two, two, 2, 1, 2.0 + 901.0) == ("down", 1)
    # a policy without standby never keeps the second replica
    plain = new_policy()
    learn(plain)
    assert plain.decide(burst, burst, quiet, 1, 1, 2.0) == ("up", 2)
    assert plain.decide(after, after, after, 3, 1, 100.0) == ("down", 1)


def test_a_burst_is_measured_against_a_minute_not_the_look_back():
    policy = new_policy(standby_replicas=1)
    learn(policy)  # 1.5/s
    current = 1
    for t in range(1, 21):  # 6/s, and Serve's look-back average has already caught up
        burst = load(current, arrivals=6.0, usage=1.2, finished=6.0, running=72)
        current = policy.decide(burst, burst, burst, current, 1, float(t))[1]
    # against the 60 s average the rise is still a burst, so after it the standby stays
    after = load(current, arrivals=1.5, usage=0.3, finished=1.5, running=18)
    assert (current, policy.decide(after, after, after, current, 1, 100.0)) == (3, ("down", 2))


def test_poisson_noise_on_a_quiet_fleet_is_not_a_burst():
    policy = new_policy(standby_replicas=1)  # capacity not learnt yet: no half-replica floor
    calm = load(1, arrivals=0.5, usage=0.1, running=2)
    assert policy.decide(calm, calm, calm, 1, 1, 0.0) == ("hold", 1)
    # 1.2/s over the 6 s panic window against 0.5/s: over 2x, but 7 arrivals where 3 were
    # expected is within 3 standard deviations (0.5 + 3 * sqrt(0.5 / 6) = 1.37/s)
    noisy = load(1, arrivals=1.2, usage=0.1, running=2)
    assert policy.decide(noisy, noisy, calm, 1, 1, 1.0) == ("hold", 1)
    burst = load(1, arrivals=2.0, usage=0.1, running=2)  # beyond the noise: standby kept
    assert policy.decide(burst, burst, calm, 1, 1, 2.0) == ("up", 2)


def test_the_trend_floor_leads_a_slow_ramp():
    ramp = new_policy(predictive_floor="trend", trend_window_s=60.0)
    flat = new_policy()
    for p in (ramp, flat):
        learn(p)
    # arrivals rise 0.05/s each second; at t = 60 they are 4/s: a replica serves 4
    for t in range(61):
        window = load(1, arrivals=1.0 + 0.05 * t, usage=0.3, finished=1.5, running=18)
        ramp_answer = ramp.decide(window, window, window, 1, 1, float(t))
        flat_answer = flat.decide(window, window, window, 1, 1, float(t))
    # 30 s ahead the line is at 5.5/s: ceil(5.5 / 4) = 2 replicas before they are needed
    assert ramp_answer == ("up", 2)
    assert flat_answer == ("hold", 1)


def test_capacity_is_the_one_measured_at_the_highest_usage():
    policy = new_policy()
    light = load(1, usage=0.2, finished=2.0)  # 10/s per full replica, when nearly idle
    full = load(2, usage=1.6, finished=9.6)  # 6/s per full replica at 80%
    policy.decide(light, light, light, 1, 1, 0.0)
    assert policy.capacity.per_usage == pytest.approx(10.0)
    policy.decide(full, full, full, 2, 1, 1.0)
    policy.decide(light, light, light, 2, 1, 2.0)
    assert policy.capacity.per_usage == pytest.approx(6.0)  # the fuller one counts
    policy.decide(light, light, light, 2, 1, 700.0)  # ten minutes later it is forgotten
    assert policy.capacity.per_usage == pytest.approx(10.0)
    # a ramp: 5/s arrive, the cache fills, completions lag behind: not a capacity reading
    ramp = load(1, usage=0.9, finished=1.0, arrivals=5.0)
    policy.decide(ramp, ramp, ramp, 1, 1, 701.0)
    assert policy.capacity.per_usage == pytest.approx(10.0)


def _context(per_replica: dict[str, list[float]], queued: float = 0.0) -> AutoscalingContext:
    n = len(per_replica[WAITING])
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(n)]
    now = time.time()
    metrics = {name: dict(zip(ids, values)) for name, values in per_replica.items()}
    raw = {name: {rid: [TimeStampedValue(now - 1, v)] for rid, v in m.items()}
           for name, m in metrics.items()}
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=n, target_num_replicas=n, running_replicas=ids,
        total_num_requests=0.0, total_queued_requests=queued, aggregated_metrics=metrics,
        raw_metrics=raw, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, look_back_period_s=LOOK_BACK))


def test_the_routers_forwarded_demand_is_read_once_not_summed_over_workers():
    ctx = _context({WAITING: [2.0, 1.0], RUNNING: [10.0, 10.0], KV_USAGE: [0.7, 0.7],
                    FINISHED_PER_S: [3.0, 4.0], DEMAND_ARRIVALS: [7.0, 7.0],
                    DEMAND_WAITING: [5.0, 5.0]}, queued=2.0)
    got = Load.from_context(ctx)
    assert got.arrivals == 7.0  # every Worker forwards the same Routers' sums
    # the Workers' queues and what the Routers hold (5, which includes the 2 calls queued at
    # their handles: not added twice)
    assert got.queue == 2.0 + 1.0 + 5.0
    assert got.finished == 7.0 and got.usage == pytest.approx(1.4)
    replicas, state = new_policy()(ctx)
    # a steady state (7 finish as 7 arrive): 7 / 1.4 = 5 requests/s per full replica
    assert state[STATE_KEY]["arrivals"] == 7.0 and state[STATE_KEY]["capacity"] == 5.0
    assert replicas == 2  # ceil(7 / (5 * 0.8)) = 2, the replicas already running


def test_bundled_policies_pass_every_setting_to_the_policy():
    for name in ("latency_first", "throughput_first", "scale_to_zero"):
        spec = load_policy(name)
        policy = QueueDepthPolicy(**spec.policy_kwargs())
        assert policy.start_s == spec.replica_start_s and policy.standby == spec.standby_replicas
        assert (policy.trend is not None) == (spec.predictive_floor == "trend")


def test_serve_default_policy_is_selectable_for_comparison():
    spec = load_policy({"policy": "serve_default", "target_ongoing_requests": 3,
                        "max_replicas": 3})
    serve_cfg = AutoscalingConfig(**spec.serve_autoscaling_config())
    assert serve_cfg.target_ongoing_requests == 3
    assert serve_cfg.policy.policy_function != "serve_app.autoscaling.policy:QueueDepthPolicy"
    with pytest.raises(ValueError, match="policy: Input should be 'queue_depth' or "
                                         "'serve_default'"):
        load_policy({"policy": "knative"})


def test_the_panic_window_defaults_below_a_short_look_back():
    fast = load_policy({"look_back_period_s": 2, "metrics_interval_s": 0.5})
    assert fast.policy_kwargs()["panic_window_s"] == 1.0  # half of the look-back
    assert load_policy({}).policy_kwargs()["panic_window_s"] == 5.0  # look-back 10 s
    assert load_policy({"look_back_period_s": 30}).policy_kwargs()["panic_window_s"] == 6.0
    with pytest.raises(ValueError, match="panic_window_s: 3.0 must be below "
                                         "look_back_period_s"):
        load_policy({"look_back_period_s": 2, "metrics_interval_s": 0.5, "panic_window_s": 3})
