"""Arrival traces: lists of ``(arrival_s, prompt_tokens, output_tokens)`` sorted by arrival.

* ``bursty``: a base rate of 1.5 requests/s with one burst to ``PEAK_RATE`` (30-90 s long) per
  5 minutes on average, at random times;
* ``diurnal``: a day compressed into the run: night at both ends, ``PEAK_RATE`` at mid-day;
* ``burstgpt``: shaped like the BurstGPT statistics (see ``burstgpt``);
* ``csv:<path>``: a user's own trace (see ``load_csv``).

``bursty`` and ``diurnal`` are non-homogeneous Poisson processes (thinning) with log-normal
prompt (median 600 tokens) and output (median 200) lengths, as the simulator has always used.
"""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

Trace = list[tuple[float, int, int]]

# Requests/s at a burst or at mid-day: about 2.5 of the modelled replicas' worth.
PEAK_RATE = 9.0
TRACES = ("bursty", "diurnal", "burstgpt")


def make_trace(name: str, duration_s: float, seed: int) -> Trace:
    """The trace called ``name`` (one of ``TRACES`` or ``csv:<path>``)."""
    if name.startswith("csv:"):
        return load_csv(name[4:])
    if name == "burstgpt":
        return burstgpt(duration_s, seed)
    if name in ("bursty", "diurnal"):
        return poisson(rate_fn(name, duration_s, seed), duration_s, seed)
    raise ValueError(f"trace: unknown trace {name!r} (known: {', '.join(TRACES)}, csv:<path>)")


def rate_fn(trace: str, duration: float, seed: int):
    """Requests/s at time t for ``bursty`` or ``diurnal``."""
    if trace == "diurnal":  # night at the ends, peak at mid-day
        return lambda t: 0.3 + (PEAK_RATE - 0.3) * (1 - math.cos(2 * math.pi * t / duration)) / 2
    rng = random.Random(seed)
    bursts = [(s, s + rng.uniform(30, 90)) for s in sorted(rng.uniform(0, duration - 90)
                                                            for _ in range(int(duration / 300)))]
    return lambda t: PEAK_RATE if any(a <= t < b for a, b in bursts) else 1.5


def poisson(rate, duration: float, seed: int, peak: float = PEAK_RATE) -> Trace:
    """Non-homogeneous Poisson arrivals by thinning, log-normal lengths."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() < rate(t) / peak:
            prompt = int(min(4000, max(16, rng.lognormvariate(math.log(600), 0.8))))
            output = int(min(1500, max(8, rng.lognormvariate(math.log(200), 0.7))))
            out.append((t, prompt, output))


# ---- BurstGPT-shaped --------------------------------------------------------------------------

GAMMA_SHAPE = 0.5      # inter-arrival Gamma shape (< 1: burstier than Poisson, CV = 1/sqrt(k))
ZIPF_EXPONENT = 1.1    # token-length power law
LEVEL_WINDOW_S = 120.0  # the mean rate is redrawn every this many seconds
PROMPT_RANGE, OUTPUT_RANGE = (16, 4000), (8, 1500)


def burstgpt(duration: float, seed: int, mean_rate: float = 0.5 * PEAK_RATE) -> Trace:
    """Arrivals and lengths shaped like the BurstGPT trace (Wang et al., "BurstGPT: A Real-world
    Workload Dataset to Optimize LLM Serving Systems", arXiv 2401.17644; data and the
    BurstGPT-Perf generator at github.com/HPMLL/BurstGPT).

    What is taken from there, and how:

    * Inter-arrival times: the paper fits the gaps between requests of the Azure OpenAI services
      with Gamma distributions whose parameters differ from period to period, and finds the
      conversation service burstier than a Poisson process would be (Gamma shape below 1). The
      BurstGPT-Perf generator's modelled mode draws gaps from Gamma(shape 0.5, scale 2). Here the
      gaps are Gamma with shape ``GAMMA_SHAPE`` = 0.5 (coefficient of variation 1.41, where
      Poisson has 1), and the mean rate is redrawn every ``LEVEL_WINDOW_S`` (log-normal around
      ``mean_rate``, sigma 0.5, capped at 1.5x ``PEAK_RATE``) to stand for the period-to-period
      change of the fitted parameters.
    * Request and response lengths: the paper models token counts with Zipf laws, and the
      generator samples both with exponent 1.1. Here both are Zipf with exponent
      ``ZIPF_EXPONENT`` = 1.1, bounded to 16-4,000 prompt and 8-1,500 response tokens (the other
      traces' bounds): means of about 600 and 240 tokens, medians of about 170 and 60, a long tail.
      Those means sit in the range of the published CSV's rows (requests of a few hundred to
      ~1,800 tokens, responses of tens to ~1,700).
    """
    rng = random.Random(seed)
    out: Trace = []
    t, level_end, rate = 0.0, 0.0, mean_rate
    while True:
        if t >= level_end:
            rate = min(1.5 * PEAK_RATE, mean_rate * rng.lognormvariate(-0.125, 0.5))
            level_end += LEVEL_WINDOW_S
        t += rng.gammavariate(GAMMA_SHAPE, 1.0 / (GAMMA_SHAPE * rate))
        if t >= duration:
            return out
        out.append((t, _zipf(rng, *PROMPT_RANGE), _zipf(rng, *OUTPUT_RANGE)))


def _zipf(rng: random.Random, lo: int, hi: int, a: float = ZIPF_EXPONENT) -> int:
    """A power law p(x) ~ x^-a on [lo, hi], by inverting its CDF."""
    e = 1.0 - a
    u = rng.random()
    return int((lo ** e + u * (hi ** e - lo ** e)) ** (1.0 / e))


# ---- a user's trace ---------------------------------------------------------------------------

def load_csv(path: str | Path) -> Trace:
    """A trace from a CSV file: one request a row, three columns: arrival time in seconds from
    the start (any start; rows in any order), prompt tokens, output tokens. A first row that is
    not numbers is a header and skipped. A bad file is a ``ValueError`` with one line naming the
    file, the row and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the trace: {exc.strerror}") from None
    out: Trace = []
    for n, row in enumerate(csv.reader(text.splitlines()), start=1):
        if not row or not "".join(row).strip():
            continue
        if len(row) < 3:
            raise ValueError(f"{path}: row {n}: expected 3 columns (arrival_s, prompt_tokens, "
                             f"output_tokens), got {len(row)}")
        try:
            arrival, prompt, output = float(row[0]), int(row[1]), int(row[2])
        except ValueError:
            if n == 1 and not out:
                continue  # a header
            raise ValueError(f"{path}: row {n}: not numbers: {','.join(row[:3])!r}") from None
        if not math.isfinite(arrival) or arrival < 0 or prompt < 1 or output < 1:
            raise ValueError(f"{path}: row {n}: need arrival_s >= 0, prompt_tokens >= 1 and "
                             f"output_tokens >= 1, got {','.join(row[:3])!r}")
        out.append((arrival, prompt, output))
    if not out:
        raise ValueError(f"{path}: no requests in the trace")
    out.sort()
    return out

