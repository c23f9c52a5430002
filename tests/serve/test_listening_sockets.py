"""No socket of the app listens beyond loopback, but what the README names, in every mode.

The lifecycle tests (``test_ingress_lifecycle.py``) check one Worker under ``serve run
serve_app:app``; here the other modes, each started as a user starts it from a plain shell:
``pagedserve serve`` with two tensor-parallel ranks (the ranks' rendezvous and the gloo group's
sockets), and ``serve run`` with two Worker replicas. The tensor-parallel run is given a
non-loopback interface in ``GLOO_SOCKET_IFNAME``, as a multi-node habit would, so the test does
not depend on this machine's host name resolving to 127.0.0.1 (gloo's default interface).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from .test_ingress_lifecycle import (
    SERVE,
    ServeRun,
    _wait,
    busy_ports,
    listeners,
    wide_listeners,
)

PAGEDSERVE = str(Path(SERVE).with_name("pagedserve"))


def _external_interface() -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` naming an interface other than loopback, where there is one."""
    names = sorted(n for n in os.listdir("/sys/class/net") if n != "lo")
    return {"GLOO_SOCKET_IFNAME": names[0]} if names else {}


MODES = {
    "pagedserve-serve-tp2": ((PAGEDSERVE, "serve", "--tensor-parallel-size", "2"),
                             _external_interface()),
    "serve-run-two-workers": ((SERVE, "run", "serve_app:build_app", "num_workers=2"), {}),
}


def _serves(run: ServeRun) -> bool:
    """A completion comes back: every rank and Worker has joined and served a step."""
    if run.proc.poll() is not None or not run.healthy():
        return run.proc.poll() is not None
    reply = httpx.post("http://127.0.0.1:8000/v1/completions", timeout=60,
                       json={"model": "pagedserve-default", "prompt": "Hi", "max_tokens": 2})
    return reply.status_code == 200


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_nothing_listens_beyond_loopback(mode):
    if busy_ports():
        pytest.skip(f"Serve's ports are in use on this machine: {busy_ports()}")
    command, env = MODES[mode]
    run = ServeRun(command, **env)
    try:
        _wait(lambda: _serves(run), 240)
        assert run.proc.poll() is None and _serves(run), run.tail()
        workers = run.pids_of("ray::ServeReplica:default:Worker")
        ranks = run.pids_of("ray::RankActor")
        assert (len(workers), len(ranks)) == ((1, 1) if "tp2" in mode else (2, 0))
        assert listeners(run)  # the scan sees this run's sockets
        assert wide_listeners(run) == []
    finally:
        run.end()
        run.clean_up()
