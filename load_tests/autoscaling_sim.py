"""The autoscaling comparison, one command: ``python load_tests/autoscaling_sim.py [--quick]``.

The simulator and its baselines live in ``load_tests/autoscaling/`` (see docs/perf/autoscaling.md);
this file only runs ``load_tests.autoscaling.runner.main`` from a checkout.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from load_tests.autoscaling.runner import main  # noqa: E402

if __name__ == "__main__":
    main()
