"""``QueueDepthPolicy`` as a unit (real ``AutoscalingContext``s in, replica counts out) and the
policy files (``deploy/autoscaling/*.yaml``, file paths, inline mappings) with their errors.
No Ray cluster."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from serve_app.app import build_app, worker_options
from serve_app.autoscaling.config import (
    POLICY_DIR,
    AutoscalingPolicyConfig,
    bundled_policies,
    load_policy,
)
from serve_app.autoscaling.policy import STATE_KEY, QueueDepthPolicy
from serve_app.config import AppConfig

ROOT = Path(__file__).resolve().parents[2]
DEP = DeploymentID(name="Worker", app_name="app")


def ctx(waiting: list[float], running: list[float] | None = None,
        kv: list[float] | None = None, *, slots: list[float] | None = None,
        latest: dict[str, list[float]] | None = None, target: int | None = None,
        queued: float = 0.0,
        min_replicas: int = 1, max_replicas: int = 8, policy_state: dict | None = None,
        config: AutoscalingConfig | None = None) -> AutoscalingContext:
    """A context for ``len(waiting)`` running replicas with these per-replica averages."""
    n = len(waiting)
    ids = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(n)]
    running = running if running is not None else [0.0] * n
    kv = kv if kv is not None else [0.0] * n
    metrics = {"num_waiting": dict(zip(ids, waiting)), "num_running": dict(zip(ids, running)),
               "kv_cache_usage": dict(zip(ids, kv)),
               "output_tokens_per_s": dict.fromkeys(ids, 100.0)}
    if slots is not None:
        metrics["seq_slot_usage"] = dict(zip(ids, slots))
    # raw time series: an older point at the window's average, then the latest report
    now = time.time()
    last = {**metrics, **{name: dict(zip(ids, v)) for name, v in (latest or {}).items()}}
    raw = {name: {rid: [TimeStampedValue(now - 1, v), TimeStampedValue(now, last[name][rid])]
                  for rid, v in per_rid.items()}
           for name, per_rid in metrics.items()}
    return AutoscalingContext(
        deployment_id=DEP, deployment_name=DEP.name, app_name=DEP.app_name,
        current_num_replicas=n, target_num_replicas=n if target is None else target,
        running_replicas=ids, total_num_requests=sum(waiting) + sum(running) + queued,
        total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics=raw,
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state=policy_state or {}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=time.time(),
        config=config or AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas))


def new_policy(**kwargs: float) -> QueueDepthPolicy:
    return QueueDepthPolicy(**{"target_queue_per_replica": 4, "max_kv_usage": 0.8,
                               "downscale_threshold": 0.5, **kwargs})


@pytest.fixture
def policy() -> QueueDepthPolicy:
    return new_policy()


# ---- the decision rule -----------------------------------------------------------------------

def test_scales_up_when_the_queue_per_replica_is_over_target(policy):
    replicas, state = policy(ctx(waiting=[9.0]))  # 9 waiting on 1 replica, target 4
    assert replicas == 3  # ceil(9 / 4)
    assert state[STATE_KEY]["decision"] == "up"
    assert policy(ctx(waiting=[5.0, 4.0]))[0] == 3  # 4.5 per replica over 2
    assert policy(ctx(waiting=[4.0, 4.0]))[0] == 2  # exactly on target: not over it


def test_counts_the_batch_each_new_replica_will_run(policy):
    # 12 wait beside a batch of 40: a second replica running 40 leaves none waiting
    assert policy(ctx(waiting=[12.0], running=[40.0]))[0] == 2  # ceil(52 / (40 + 4))
    assert policy(ctx(waiting=[100.0], running=[40.0]))[0] == 4  # ceil(140 / 44)


def test_a_burst_counts_at_once_not_diluted_in_the_window(policy):
    # the window's average shows no queue yet; the latest reports show 12 waiting
    burst = ctx(waiting=[0.0], running=[30.0], latest={"num_waiting": [12.0],
                                                       "num_running": [40.0]})
    assert policy(burst)[0] == 2
    # a quiet window but a queue now: no scale-down
    now_busy = ctx(waiting=[0.0, 0.0], latest={"num_waiting": [3.0, 2.0]})
    assert policy(now_busy)[0] == 2
    assert new_policy()(ctx(waiting=[0.0, 0.0]))[0] == 1  # a policy not in a burst


def test_scales_up_when_a_replica_is_fuller_than_the_bound(policy):
    assert policy(ctx(waiting=[0.0], kv=[0.9]))[0] == 2  # ceil(0.9 / 0.8)
    # one full replica beside an empty one: the router sends new work to the empty one
    assert policy(ctx(waiting=[0.0, 0.0], kv=[0.9, 0.1]))[0] == 2
    # short requests: sequence slots fill before the cache does
    assert policy(ctx(waiting=[0.0], kv=[0.2], slots=[0.95]))[0] == 2


def test_counts_calls_queued_at_the_routers(policy):
    assert policy(ctx(waiting=[2.0], queued=7.0))[0] == 3  # ceil((2 + 7) / 4)


def test_holds_inside_the_hysteresis_band(policy):
    # 3 waiting on 2 replicas: under target 4 (no up), over 0.5 * 4 per replica on 1 (no down)
    replicas, state = policy(ctx(waiting=[2.0, 1.0]))
    assert (replicas, state[STATE_KEY]["decision"]) == (2, "hold")
    # no queue, but the caches would be 1.0 / 1 > 0.5 * 0.8 on one replica
    assert policy(ctx(waiting=[0.0, 0.0], kv=[0.5, 0.5]))[0] == 2
    # replicas still starting (target 3, 1 running): their coming capacity counts
    assert policy(ctx(waiting=[9.0], target=3))[0] == 3


def test_scales_down_to_what_the_load_needs(policy):
    replicas, state = policy(ctx(waiting=[0.0, 0.0, 1.0, 0.0], kv=[0.1, 0.2, 0.2, 0.0]))
    assert replicas == 2  # max(ceil(1 / 2), ceil(0.5 / 0.4)) = 2
    assert state[STATE_KEY]["decision"] == "down"
    assert policy(ctx(waiting=[0.0, 0.0], running=[3.0, 1.0], kv=[0.1, 0.1]))[0] == 1


def test_scales_to_zero_only_when_idle_and_allowed(policy):
    idle = dict(waiting=[0.0, 0.0], running=[0.0, 0.0])
    assert policy(ctx(**idle, min_replicas=0))[0] == 0
    assert policy(ctx(**idle, min_replicas=1))[0] == 1
    assert policy(ctx(waiting=[0.0], running=[1.0], min_replicas=0))[0] == 1  # still generating
    assert policy(ctx(waiting=[], min_replicas=0, target=0))[0] == 0  # stays at zero
    assert policy(ctx(waiting=[], queued=1.0, min_replicas=0, target=0))[0] == 1


def test_no_scale_down_while_replicas_start(policy):
    # target 2, one replica running and idle, one starting: wait for its reports
    replicas, state = policy(ctx(waiting=[0.0], target=2, min_replicas=0))
    assert (replicas, state[STATE_KEY]["decision"]) == (2, "hold")
    assert policy(ctx(waiting=[], target=1, min_replicas=0))[0] == 1  # the first one starting


def test_answers_stay_within_the_bounds(policy):
    assert policy(ctx(waiting=[400.0], max_replicas=4))[0] == 4
    replicas, state = policy(ctx(waiting=[400.0] * 4, max_replicas=4))
    assert (replicas, state[STATE_KEY]["decision"]) == (4, "hold")  # at the bound
    assert new_policy()(ctx(waiting=[0.0, 0.0, 0.0], min_replicas=2))[0] == 2


def test_policy_state_is_kept_and_extended(policy):
    _, state = policy(ctx(waiting=[9.0], policy_state={"other": 1}))
    assert state["other"] == 1
    assert state[STATE_KEY]["queue"] == 9.0 and state[STATE_KEY]["desired"] == 3


def test_bad_policy_kwargs_are_rejected():
    with pytest.raises(ValueError, match="target_queue_per_replica must be > 0"):
        QueueDepthPolicy(target_queue_per_replica=0)
    with pytest.raises(ValueError, match="max_kv_usage"):
        QueueDepthPolicy(max_kv_usage=1.5)


def test_serves_delays_make_scale_down_wait_for_an_unbroken_quiet_spell(policy):
    """Through the wrapper Serve's controller puts around every custom policy: a 'hold' (queue
    back above the band) restarts the downscale delay."""
    wrapped = _apply_autoscaling_config(policy)
    config = AutoscalingConfig(min_replicas=1, max_replicas=8, upscale_delay_s=0,
                               downscale_delay_s=1.0)
    state: dict = {}

    def tick(waiting: list[float]) -> int:
        nonlocal state
        replicas, state = wrapped(ctx(waiting=waiting, policy_state=state, config=config))
        return replicas

    quiet, busy = [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]
    assert tick(quiet) == 3  # quiet spell starts
    time.sleep(0.6)
    assert tick(busy) == 3  # 'hold' breaks it
    assert tick(quiet) == 3  # starts again
    time.sleep(0.5)
    assert tick(quiet) == 3  # 0.5s < 1s (1.1s since the first quiet tick)
    time.sleep(0.6)
    assert tick(quiet) == 1  # unbroken for 1.1s


# ---- policy files --------------------------------------------------------------------------

def test_bundled_policies_load_and_serve_accepts_them():
    assert {"latency_first", "throughput_first", "scale_to_zero"} <= set(bundled_policies())
    for name in bundled_policies():
        text = (POLICY_DIR / f"{name}.yaml").read_text()
        data = yaml.safe_load(text)
        assert set(data) == set(AutoscalingPolicyConfig.model_fields), name  # every field given
        lines = text.splitlines()
        for i, line in enumerate(lines):  # each field under a comment that describes it
            if line and not line.startswith("#"):
                assert lines[i - 1].startswith("# "), (name, line)
        serve_cfg = AutoscalingConfig(**load_policy(name).serve_autoscaling_config())
        assert serve_cfg.policy.policy_function == "serve_app.autoscaling.policy:QueueDepthPolicy"
    assert load_policy("scale_to_zero").min_replicas == 0


def test_name_path_and_inline_mapping_give_the_same_policy(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((POLICY_DIR / "latency_first.yaml").read_text())
    inline = yaml.safe_load(path.read_text())
    assert load_policy("latency_first") == load_policy(str(path)) == load_policy(inline)
    partial = load_policy({"min_replicas": 0, "max_replicas": 2})  # the rest defaults
    assert partial.target_queue_per_replica == AutoscalingPolicyConfig().target_queue_per_replica


def _write(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load((POLICY_DIR / "latency_first.yaml").read_text()) | changes
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("changes, field, reason", [
    ({"target_queue": 3}, "target_queue", "unknown field"),
    ({"target_queue_per_replica": -2}, "target_queue_per_replica", "greater than 0"),
    ({"min_replicas": 5, "max_replicas": 2}, "min_replicas", "above max_replicas"),
    ({"max_kv_usage": 1.5}, "max_kv_usage", "less than or equal to 1"),
    ({"initial_replicas": 9}, "initial_replicas", "outside"),
    ({"metrics_interval_s": 20}, "look_back_period_s", "above metrics_interval_s"),
])
def test_bad_policy_file_names_file_field_and_reason(tmp_path, changes, field, reason):
    path = _write(tmp_path, **changes)
    with pytest.raises(ValueError) as err:
        load_policy(str(path))
    message = str(err.value)
    assert str(path) in message and field in message and reason in message, message
    # the same at start-up, through Serve's builder call
    with pytest.raises(ValueError) as err:
        call_user_app_builder_with_args_if_necessary(build_app, {"autoscaling": str(path)})
    assert str(path) in str(err.value) and field in str(err.value)


def test_unknown_name_missing_file_and_inline_errors(tmp_path):
    with pytest.raises(ValueError, match="no bundled policy 'fastest'.*latency_first"):
        load_policy("fastest")
    with pytest.raises(ValueError, match="cannot read"):
        load_policy(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_policy(str(tmp_path / "list.yaml"))
    with pytest.raises(ValueError, match="inline autoscaling policy: max_replicas"):
        load_policy({"max_replicas": 0})


# ---- the app's options -----------------------------------------------------------------------

def test_worker_options_carry_the_policy_and_the_drain():
    cfg = AppConfig(accelerator="cpu", autoscaling="latency_first", worker_drain_timeout_s=60)
    opts = worker_options(cfg)
    assert "num_replicas" not in opts
    serve_cfg = AutoscalingConfig(**opts["autoscaling_config"])
    assert (serve_cfg.min_replicas, serve_cfg.max_replicas) == (1, 4)
    kwargs = serve_cfg.policy.policy_kwargs
    assert kwargs == load_policy("latency_first").policy_kwargs()
    assert (kwargs["target_queue_per_replica"], kwargs["max_kv_usage"]) == (2.0, 0.9)
    assert QueueDepthPolicy(**kwargs).standby == kwargs["standby_replicas"]
    assert (opts["graceful_shutdown_timeout_s"], opts["graceful_shutdown_wait_loop_s"]) == (60, 0.5)
    fixed = worker_options(AppConfig(accelerator="cpu", num_workers=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert AppConfig(autoscaling="scale_to_zero").scales_to_zero()
    assert not AppConfig(autoscaling="latency_first").scales_to_zero()


def test_num_workers_and_autoscaling_are_exclusive():
    with pytest.raises(ValueError, match="num_workers"):
        AppConfig.model_validate({"num_workers": 2, "autoscaling": "latency_first"})


def test_serve_config_file_uses_a_bundled_policy():
    data = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    cfg = AppConfig.model_validate(data["applications"][0]["args"])
    assert cfg.autoscaling == load_policy("latency_first")
