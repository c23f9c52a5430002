"""What ``QueueDepthPolicy`` learns from its inputs over time: a replica's capacity and the
arrival rate's trend. Standard library only: Serve's controller imports it (the policy module
itself is pickled by value and refers to these classes by reference)."""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

CAPACITY_MEMORY_S = 600.0  # how long a capacity observation is kept
MIN_OBSERVED_USAGE = 0.05  # per replica: below it finished/usage is noise
# Capacity is read only in a steady state: arrivals within this share of completions. While
# load rises, usage grows before completions catch up and finished/usage reads low.
STEADY_TOLERANCE = 0.2


class Observed(Protocol):
    """What ``Capacity`` reads of a window (``serve_app.autoscaling.policy.Load``)."""

    replicas: int
    usage: float
    finished: float
    arrivals: float


class Capacity:
    """Requests/s one replica finishes per unit of usage (see ``serve_app.autoscaling.policy``).

    The observations of the last ``CAPACITY_MEMORY_S`` are kept as a sliding-window maximum by
    per-replica usage: an observation is dropped once a later one at the same usage or higher
    exists (it can never be the answer again), so the front is always the fullest, and the
    latest among equals. O(1) per observation, amortised, on Serve's 0.1 s ticks too.
    """

    def __init__(self) -> None:
        self._seen: deque[tuple[float, float, float]] = deque()  # (time, usage/replica, rate)

    def observe(self, window: Observed, now: float) -> None:
        while self._seen and self._seen[0][0] < now - CAPACITY_MEMORY_S:
            self._seen.popleft()
        if window.replicas and window.finished > 0 and (
                window.arrivals <= 0 or abs(window.arrivals - window.finished)
                <= STEADY_TOLERANCE * window.finished):
            per_replica = window.usage / window.replicas
            if per_replica >= MIN_OBSERVED_USAGE:
                while self._seen and self._seen[-1][1] <= per_replica:
                    self._seen.pop()
                self._seen.append((now, per_replica, window.finished / window.usage))

    @property
    def per_usage(self) -> float | None:
        """At the highest usage observed in the window (the latest among equals)."""
        return self._seen[0][2] if self._seen else None


class Trend:
    """The arrival rate's least-squares line over a trailing window, one point a second."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"QueueDepthPolicy: trend_window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._points: deque[tuple[float, float]] = deque()

    def add(self, now: float, rate: float) -> None:
        if self._points and now - self._points[-1][0] < 1.0:
            return
        self._points.append((now, rate))
        while self._points[0][0] < now - self.window_s:
            self._points.popleft()

    def predict(self, ahead_s: float) -> float:
        """The rate ``ahead_s`` after the last point: never below it (a floor only rises)."""
        if len(self._points) < 3:
            return 0.0
        n = len(self._points)
        mt = sum(t for t, _ in self._points) / n
        mr = sum(r for _, r in self._points) / n
        var = sum((t - mt) ** 2 for t, _ in self._points)
        slope = sum((t - mt) * (r - mr) for t, r in self._points) / var if var else 0.0
        t_last, r_last = self._points[-1]
        return max(r_last, mr + slope * (t_last + ahead_s - mt))


class Baseline:
    """The arrival rate averaged over a long window (an exponential moving average with that
    time constant): what a burst is measured against, as Knative's 60 s stable window."""

    def __init__(self, window_s: float) -> None:
        self.window_s, self.rate = window_s, 0.0
        self._at: float | None = None

    def update(self, now: float, rate: float) -> float:
        if self._at is None:
            self.rate = rate
        elif now > self._at:
            self.rate += (rate - self.rate) * (1.0 - math.exp(-(now - self._at) / self.window_s))
        self._at = now
        return self.rate
