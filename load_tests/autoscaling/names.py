"""Metric names, from ``serve_app.autoscaling.signals`` (what ``Worker.record_autoscaling_stats()``
reports), in the order a simulated replica's samples carry them."""

from __future__ import annotations

from serve_app.autoscaling.signals import (
    DEMAND_ARRIVALS,
    DEMAND_PROMPT_TPS,
    DEMAND_WAITING,
    FINISHED_PER_S,
    KV_USAGE,
    RUNNING,
    SLOT_USAGE,
    TOKENS_PER_S,
    WAITING,
)

METRICS = (WAITING, RUNNING, KV_USAGE, SLOT_USAGE, TOKENS_PER_S, FINISHED_PER_S,
           DEMAND_ARRIVALS, DEMAND_PROMPT_TPS, DEMAND_WAITING)
DEMAND = (DEMAND_ARRIVALS, DEMAND_PROMPT_TPS, DEMAND_WAITING)  # the same on every replica
