"""The autoscaling comparison: a simulated fleet of Worker replicas, pagedserve's policy and the
other autoscalers' policies on the same traces (docs/perf/autoscaling.md).

* ``traces``: bursty, diurnal, BurstGPT-shaped, a user's CSV;
* ``fleet``: the modelled replica and the Router (routing, standby, demand reports);
* ``sim``: one run under one policy, as Serve's controller runs it; TTFT and cost;
* ``baselines``, ``kpa``, ``llmd``: Serve's default, fixed, oracle; Knative and AIBrix; llm-d;
* ``policies``: every policy by label; ``runner``: the matrix, JSON lines; ``report``: the
  table and the plot. Entry point: ``load_tests/autoscaling_sim.py``.
"""
