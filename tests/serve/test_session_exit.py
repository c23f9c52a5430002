"""A test session that used Ray ends as any other: ``pytest.main()`` returns to its caller with
the verdict, and what runs after it (the caller's code, ``atexit`` hooks) still runs and shows.

``tests/conftest.py`` stops Ray and Serve's handle loop at the end of the session rather than
leaving the process with ``os._exit``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from .cluster import ROOT

A_RAY_TEST = '''
from ray import serve

from tests.serve.cluster import local_ray


@serve.deployment
class Echo:
    def __call__(self, word: str) -> str:
        return word


def test_a_handle_call_on_a_local_cluster():
    with local_ray(num_cpus=2):
        handle = serve.run(Echo.bind(), name="echo", route_prefix=None)
        assert handle.remote("ok").result(timeout_s=60) == "ok"
'''

CALLER = '''
import atexit
import sys

import pytest

atexit.register(lambda: print("atexit ran", flush=True))
status = pytest.main(["-q", "-p", "tests.conftest", "-p", "no:cacheprovider", sys.argv[1]])
print(f"pytest.main returned {int(status)}", flush=True)
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pytest_main_returns_after_a_session_that_used_ray(tmp_path):
    test_file = tmp_path / "test_uses_ray.py"
    test_file.write_text(A_RAY_TEST)
    # a fresh shell's environment: earlier tests in this process set Ray Serve's switches
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", CALLER, str(test_file)], cwd=ROOT, env=plain,
                         capture_output=True, text=True, timeout=280)
    tail = (out.stdout + out.stderr)[-3000:]
    assert "1 passed" in out.stdout, tail
    assert "pytest.main returned 0\n" in out.stdout, tail
    assert out.stdout.endswith("atexit ran\n"), tail
    assert out.returncode == 0, tail
