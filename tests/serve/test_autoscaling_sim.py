"""The autoscaling simulator (load_tests/autoscaling/): TTFT and SLO arithmetic, the signals it
feeds the policies, standby routing, the traces and the CSV loader's errors."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from load_tests.autoscaling import traces
from load_tests.autoscaling.baselines import fixed
from load_tests.autoscaling.fleet import Replica, Req, Router
from load_tests.autoscaling.names import (
    DEMAND_ARRIVALS,
    DEMAND_PROMPT_TPS,
    DEMAND_WAITING,
    FINISHED_PER_S,
)
from load_tests.autoscaling.sim import Sim


def run_cfg(**kw) -> SimpleNamespace:
    base = dict(tick_s=0.1, control_period_s=0.5, start_s=5.0, prefill_tokens_per_s=400.0,
                ttft_slo_s=1.0, duration_s=1.0)
    return SimpleNamespace(**{**base, **kw})


def test_ttft_is_queue_wait_plus_prefill_on_three_requests():
    # one replica, one sequence slot, 0.1 s steps: each request's 5 tokens take 5 ticks.
    # All three arrive at 0: admitted at 0.0, 0.5 and 1.0; prompts of 100, 200 and 400 tokens at
    # 400 tokens/s prefill: TTFT 0 + 0.25, 0.5 + 0.5, 1.0 + 1.0
    hw = SimpleNamespace(max_num_seqs=1, kv_tokens=10_000, step_base_s=0.1, step_per_seq_s=0.0)
    sim = Sim(*fixed(1), hw, run_cfg())
    out = sim.run([(0.0, 100, 5), (0.0, 200, 5), (0.0, 400, 5)])
    assert [r.start for r in sim.requests] == [0.0, 0.5, 1.0]
    assert out == {"replica_s": 1.5, "requests": 3, "p50_ttft_s": 1.0, "p95_ttft_s": 2.0,
                   "p99_ttft_s": 2.0, "slo_attainment": 0.6667, "peak_replicas": 1}


def recorded_contexts(trace, **kw) -> list:
    seen = []
    policy, cfg = fixed(2)

    def recording(ctx):
        seen.append(ctx)
        return policy(ctx)

    hw = SimpleNamespace(max_num_seqs=64, kv_tokens=48_000, step_base_s=0.02,
                         step_per_seq_s=0.0006)
    Sim(recording, cfg, hw, run_cfg(**kw)).run(trace)
    return seen


def test_every_replica_reports_the_routers_demand_and_its_finished_rate():
    # 4 requests/s of 100-token prompts for 20 s
    trace = [(i * 0.25, 100, 20) for i in range(80)]
    ctx = next(c for c in recorded_contexts(trace, duration_s=20.0) if c.current_time == 15.0)
    assert len(ctx.running_replicas) == 2
    for name, want in ((DEMAND_ARRIVALS, 4.0), (DEMAND_PROMPT_TPS, 400.0), (DEMAND_WAITING, 0)):
        assert set(ctx.aggregated_metrics[name].values()) == {want}, name
        assert {s[-1].value for s in ctx.raw_metrics[name].values()} == {want}, name
    # finished/s over 10 s summed over the replicas: the 4 requests/s that arrive
    assert sum(ctx.aggregated_metrics[FINISHED_PER_S].values()) == pytest.approx(4.0, abs=0.5)
    assert ctx.total_queued_requests == 0.0


def test_router_reports_arrivals_prompt_tokens_and_what_it_holds_each_second():
    router = Router()
    router.accept(Req(0.0, 100, 5))
    router.accept(Req(0.5, 300, 5))
    router.report(0.5)  # the first report: 2 requests, 400 prompt tokens in the last 2 s, held
    assert router.demand == (1.0, 200.0, 2.0)
    router.route([replica(1)])
    router.report(0.9)  # within the second: the last report stands
    assert router.demand == (1.0, 200.0, 2.0)
    router.report(2.2)  # the request at 0.0 is out of the 2 s window; nothing held
    assert router.demand == (0.5, 150.0, 0.0)


def replica(index: int, waiting: int = 0) -> Replica:
    hw = SimpleNamespace(max_num_seqs=64, kv_tokens=1000, step_base_s=0.02, step_per_seq_s=0.0)
    r = Replica(rid=f"r{index}", index=index, ready_at=0.0, hw=hw)
    for _ in range(waiting):
        r.waiting.append(Req(0.0, 10, 10))
    return r


def test_standby_replica_gets_a_request_only_when_every_other_is_full():
    old, young = replica(1), replica(2)
    router = Router(standby=1, full_queue=2, full_kv=0.9)
    for _ in range(2):
        router.accept(Req(0.0, 10, 10))
    router.route([old, young])
    assert (len(old.waiting), len(young.waiting)) == (2, 0)  # the young idle one is standby
    router.accept(Req(0.0, 10, 10))
    router.route([old, young])  # the old one is full (2 waiting): promote the standby
    assert (len(old.waiting), len(young.waiting)) == (2, 1)
    router.accept(Req(0.0, 10, 10))
    router.route([old, young])  # both active now, none idle: least loaded
    assert (len(old.waiting), len(young.waiting)) == (2, 2)


def test_kv_full_replica_also_sends_a_request_to_the_standby():
    old, young = replica(1), replica(2)
    old.kv_used = 950  # 0.95 >= 0.9
    old.running = 1
    router = Router(standby=1, full_queue=100, full_kv=0.9)
    router.accept(Req(0.0, 10, 10))
    router.route([old, young])
    assert len(young.waiting) == 1


def test_burstgpt_trace_is_burstier_than_poisson_with_zipf_lengths():
    trace = traces.burstgpt(duration=100_000.0, seed=0, mean_rate=5.0)
    gaps: dict[int, list[float]] = {}  # per rate window (each has its own mean)
    for a, b in zip(trace, trace[1:]):
        if int(a[0] // traces.LEVEL_WINDOW_S) == int(b[0] // traces.LEVEL_WINDOW_S):
            gaps.setdefault(int(a[0] // traces.LEVEL_WINDOW_S), []).append(b[0] - a[0])
    within = [g / statistics.fmean(w) for w in gaps.values() if len(w) > 50 for g in w]
    cv = statistics.pstdev(within) / statistics.fmean(within)
    assert 1.3 < cv < 1.55  # Gamma shape 0.5: 1/sqrt(0.5) = 1.41; Poisson: 1
    prompts, outputs = [p for _, p, _ in trace], [o for _, _, o in trace]
    assert min(prompts) >= 16 and max(prompts) <= 4000 and min(outputs) >= 8
    assert 550 < statistics.fmean(prompts) < 650 and 150 < statistics.median(prompts) < 200
    assert 210 < statistics.fmean(outputs) < 270


def test_csv_trace_header_order_and_replay(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n2.5,100,20\n0.5,300,40\n\n")
    assert traces.make_trace(f"csv:{path}", 0, 0) == [(0.5, 300, 40), (2.5, 100, 20)]


@pytest.mark.parametrize("text, message", [
    ("0.5,100\n", "row 1: expected 3 columns"),
    ("0.5,100,20\nsoon,100,20\n", "row 2: not numbers"),
    ("0.5,100,20\n-1,100,20\n", "row 2: need arrival_s >= 0"),
    ("0.5,0,20\n", "row 1: need arrival_s >= 0, prompt_tokens >= 1"),
    ("arrival,prompt,output\n", "no requests in the trace"),
])
def test_csv_trace_errors_name_the_row(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        traces.load_csv(path)
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)


def test_csv_trace_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read the trace"):
        traces.make_trace(f"csv:{tmp_path / 'none.csv'}", 0, 0)


def test_unknown_trace_is_named():
    with pytest.raises(ValueError, match="unknown trace 'spiky'"):
        traces.make_trace("spiky", 10, 0)


def test_quick_comparison_prints_a_line_per_run(capsys):
    from load_tests.autoscaling.runner import main

    lines = main(["--quick", "--duration-s", "120", "--trace", "bursty", "--jobs", "1",
                  "--default-targets", "16", "--baselines", "knative_kpa", "fixed"])
    assert sorted(line["policy"] for line in lines) == [
        "fixed", "knative_kpa", "queue_depth", "serve_default_t16"]
    assert all(line["requests"] > 0 and line["replica_s"] > 0 for line in lines)
    assert "| 30 | queue_depth |" in capsys.readouterr().err


def test_csv_replay_runs_to_its_last_arrival(tmp_path):
    from load_tests.autoscaling.runner import main

    path = tmp_path / "mine.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" +
                    "".join(f"{i * 0.5},200,50\n" for i in range(40)))
    lines = main(["--trace", f"csv:{path}", "--seeds", "0", "--startup-s", "5", "--jobs", "1",
                  "--default-targets", "--baselines", "fixed"])
    fixed_line = next(line for line in lines if line["policy"] == "fixed")
    assert fixed_line["requests"] == 40 and fixed_line["replicas"] == 1
    assert 19.5 <= fixed_line["replica_s"] < 25  # one replica until the last arrival (19.5 s)
