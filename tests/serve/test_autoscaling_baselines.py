"""The simulator's baselines reproduce their documented behaviour on a step input
(load_tests/autoscaling/: baselines.py, kpa.py, llmd.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from load_tests.autoscaling import kpa, llmd
from load_tests.autoscaling.baselines import Oracle, fixed, passthrough, serve_default
from load_tests.autoscaling.fleet import Router
from load_tests.autoscaling.names import KV_USAGE, WAITING
from load_tests.autoscaling.sim import Sim
from tests.serve.autoscaling_script import context, play, spread

HW = SimpleNamespace(max_num_seqs=64, kv_tokens=48_000, step_base_s=0.02, step_per_seq_s=0.0006)


def step(before: float, after: float, at: float, until: float = float("inf")):
    """Total concurrency ``before`` until ``at``, ``after`` from ``at`` until ``until``."""
    return lambda t, ready: spread(after if at <= t < until else before, ready)


def test_serve_default_waits_its_upscale_delay_then_asks_ceil_ongoing_over_target():
    policy, cfg = serve_default(16.0, min_replicas=1, max_replicas=8)
    assert (cfg.upscale_delay_s, cfg.downscale_delay_s, cfg.look_back_period_s) == (30, 600, 30)
    out = play(policy, cfg, step(10, 40, at=10), until=60)
    targets = {t: n for t, n, _ in out}
    assert targets[39.5] == 1  # the step began at 10: Serve's 30 s upscale delay
    assert targets[40.0] == 3  # ceil(40 / 16)


def test_fixed_stays_fixed_through_a_burst():
    policy, cfg = fixed(2)
    trace = [(10 + i * 0.01, 500, 200) for i in range(400)]  # 100 requests/s for 4 s
    run = SimpleNamespace(tick_s=0.1, control_period_s=0.5, start_s=5.0,
                          prefill_tokens_per_s=8000.0, ttft_slo_s=2.0, duration_s=30.0)
    sim = Sim(policy, cfg, HW, run, Router())
    sim.run(trace)
    assert {n for _, n, _ in sim.series} == {2}
    assert {n for _, n in sim.targets} == {2}


def test_knative_kpa_panics_on_a_2x_burst_and_never_scales_down_in_panic():
    policy = kpa.knative_kpa(max_num_seqs=64)  # target 0.7 x 64 = 44.8 per replica
    assert (policy.stable_s, policy.panic_s, policy.panic_threshold) == (60, 6, 2.0)
    cfg = passthrough(1, 20)
    # 40 in flight (1 replica), 400 from t=100 to t=130, then 40 again
    out = play(policy, cfg, step(40, 400, at=100, until=130), until=260, start_s=5)
    targets = [(t, n) for t, n, _ in out]
    before = [n for t, n in targets if t < 100]
    assert set(before) == {1}
    # the first tick whose 6 s panic window holds a sample of the burst: its mean is
    # (400 + 5 x 40) / 6 = 100, ceil(100 / 44.8) = 3 on 1 ready replica: over 200%, panic
    first_up = next(t for t, n in targets if n > 1)
    assert first_up == 100 and dict(targets)[100] == 3
    assert policy.info["in_panic"] or dict(targets)[106] == 9  # the full window: ceil(400/44.8)
    assert dict(targets)[106] == 9
    # in panic: the load fell back at 130, the answer never goes down until the panic ends,
    # a stable window (60 s) after the last tick over the threshold
    in_panic = [n for t, n in targets if first_up <= t < 160]
    assert in_panic == sorted(in_panic) and in_panic[-1] >= 9
    assert max(n for t, n in targets if t >= 240) < 9  # after panic it scales down


def test_knative_kpa_stable_mode_sizes_on_the_stable_window():
    policy = kpa.knative_kpa(max_num_seqs=64)
    # 3 replicas at 100 in flight, 150 from t=70: ceil(150/44.8) = 4, 4/3 under the 200% panic
    # threshold, so it waits for the 60 s average (one sample a second) to pass 3 x 44.8 = 134.4:
    # at t=112 the window (53..112] holds 43 samples of 150 and 17 of 100, mean 135.8 (at
    # t=110, on its 2 s tick before, 134.2)
    out = play(policy, passthrough(1, 20, 3), step(100, 150, at=70), until=140)
    assert min(t for t, n, _ in out if n == 4) == 112
    assert max(n for _, n, _ in out) == 4 and not policy.info["in_panic"]


def test_aibrix_apa_tolerances_and_trend_floor():
    apa = kpa.APA(predictive=False)
    assert apa.reactive(2, 0.54) == 2  # 1.08x target: inside the 10% up tolerance
    assert apa.reactive(2, 0.56) == 3  # 1.12x: ceil(2 x 1.12)
    assert apa.reactive(4, 0.42) == 4  # 0.84x: inside the 20% down tolerance
    assert apa.reactive(4, 0.38) == 4  # 0.76x: ceil(4 x 0.76) = 4
    assert apa.reactive(4, 0.2) == 2   # 0.4x: ceil(1.6) = 2, at most halved
    # per-pod KV use rising from 0.10 to 0.45 over 180 s on 2 pods: reactive holds at 2;
    # the trend, projected 120 s ahead from the window's mean, asks for 3
    cfg = passthrough(1, 10)

    def rising(t, ready):
        return [{KV_USAGE: 0.10 + 0.35 * min(t, 180) / 180} for _ in range(ready)]

    for predictive, want in ((False, 2), (True, 3)):
        out = play(kpa.APA(predictive=predictive), passthrough(2, 10, 2), rising, until=180)
        assert out[-1][1] == want, predictive
    assert cfg.upscale_delay_s == 0


def test_llmd_saturation_adds_a_replica_when_spare_kv_falls_under_its_trigger():
    cfg = passthrough(1, 10)

    def kv(a: float, b: float, q: float = 0.0):
        return [{KV_USAGE: a, WAITING: q}, {KV_USAGE: b, WAITING: q}]

    s = llmd.SaturationScaler()
    assert s(context(0.0, kv(0.65, 0.75), cfg))[0] == 2  # spare (0.15 + 0.05) / 2 = 0.10
    assert s(context(30.0, kv(0.76, 0.76), cfg))[0] == 2  # between runs: the last answer
    # at 60 s: the last minute's peak, 0.76 on both: spare 0.04 < 0.1 -> ready + 1
    assert s(context(60.0, kv(0.5, 0.5), cfg))[0] == 3
    s = llmd.SaturationScaler()
    assert s(context(0.0, kv(0.3, 0.3, q=2.5), cfg))[0] == 3  # spare queue 2.5 < 3
    s = llmd.SaturationScaler()  # one fewer would still leave spare >= the triggers
    assert s(context(0.0, kv(0.2, 0.2, q=0.5) + kv(0.2, 0.2, q=0.5)[:1], cfg))[0] == 2


def test_oracle_starts_replicas_start_s_ahead_of_the_load():
    # nothing until t=100, then 30 requests/s of 200-token outputs until t=160
    trace = [(100 + i / 30, 500, 200) for i in range(60 * 30)]
    start_s = 20.0
    oracle = Oracle(trace, HW, start_s=start_s, lead_s=2.0)
    cfg = passthrough(0, 10)
    need = int(oracle.need[110])
    assert need >= 2
    answers = {t: oracle(context(float(t), [], cfg))[0] for t in range(60, 101)}
    assert answers[100 - 22 - 1] == 0       # before the lead
    assert answers[100 - 22] >= 1            # start_s + lead_s ahead of the first arrival
    assert answers[100] == max(oracle.need[100:123])


@pytest.mark.parametrize("name", ["knative_kpa", "aibrix_kpa", "aibrix_apa",
                                  "llmd_saturation", "oracle"])
def test_every_baseline_runs_behind_serves_wrapper_without_delays(name):
    from load_tests.autoscaling.policies import build, policy_spec

    spec = policy_spec("latency_first", {}, 10.0)
    _, cfg, router = build(name, spec, HW, [(0.0, 10, 10)], 10.0)
    assert (cfg.upscale_delay_s, cfg.downscale_delay_s, cfg.metrics_interval_s) == (0, 0, 1)
    assert (cfg.min_replicas, cfg.max_replicas) == (spec.min_replicas, spec.max_replicas)
    assert router.standby == 0
