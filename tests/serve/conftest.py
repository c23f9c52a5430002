"""Environment for the serving tests, set before Ray or the engine is imported."""

from __future__ import annotations

import os
import tempfile

# Loopback only (Ray 2.60 binds to eth0 otherwise), and a private default-model cache.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("PAGEDSERVE_CACHE_DIR", tempfile.mkdtemp(prefix="pagedserve-test-cache-"))
