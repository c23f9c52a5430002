"""The Router's demand reaches every Worker on a local Ray cluster: one Router, two Workers (a
tiny model). While requests arrive, both Workers report the Router's arrivals and prompt
tokens (``/v1/stats``: each Worker's ``demand``, what its ``record_autoscaling_stats`` adds),
through ``report_demand`` calls routed to each replica by name."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from serve_app import build_app

from .cluster import local_ray, make_tiny_checkpoint, wait_until

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def test_both_workers_report_the_routers_arrivals(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "tiny")
    app = build_app({"model": str(model), "dtype": "float32", "max_model_len": 128,
                     "kv_cache_memory_bytes": 4 << 20, "num_threads": 1, "accelerator": "cpu",
                     "worker_num_cpus": 0.5, "router_num_cpus": 0.5, "num_workers": 2})
    with local_ray() as base, httpx.Client(base_url=base, timeout=60) as client:
        serve.run(app, name="demand", route_prefix="/", blocking=False)
        wait_until(lambda: client.get("/health").status_code == 200, 180, "healthy")
        wait_until(lambda: len(client.get("/v1/stats").json()["workers"]) == 2, 60,
                   "both Workers known")

        def both_hear() -> list[dict]:
            for _ in range(3):  # keep arrivals within the Router's 2 s window
                reply = client.post("/v1/completions", json={"prompt": "the demand", "n": 2,
                                                             "max_tokens": 2})
                assert reply.status_code == 200, reply.text
            demand = [w["demand"] for w in client.get("/v1/stats").json()["workers"]]
            heard = len(demand) == 2 and all(d["demand_arrivals_per_s"] > 0 for d in demand)
            return demand if heard else []

        demand = wait_until(both_hear, 60, "both Workers report the Router's arrivals")
    assert all(d["demand_prompt_tokens_per_s"] > 0 for d in demand)
    assert sum(d["finished_per_s"] for d in demand) > 0  # the Workers count what they finish
