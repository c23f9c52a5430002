"""The soak's own application on a local Ray cluster (127.0.0.1 only).

``LocalApp`` starts one Ray cluster on the loopback interface, Serve's HTTP proxy on a free
loopback port and the pagedserve app, and has the means of the faults the soak must survive
(``faults.py`` drives them):

* ``kill("Worker")`` / ``kill("Router")``: SIGKILL to one replica actor's process (found in
  the GCS actor table); Serve's controller notices and starts a replacement.
* ``scale(n)``: the same config with ``num_replicas: n`` for the Worker. The app is deployed
  from a config (``import_path`` + ``args``, as ``serve deploy deploy/serve_config.yaml`` and
  KubeRay do), so Serve changes the replica count in place, draining a removed replica as
  autoscaling does. (``serve.run`` of a rebuilt app would restart every replica instead: an
  imperative deploy carries no code version, and ``Deployment.options(version=)`` is gone.)

Nothing here is imported by the serving code.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

APP = "soak"
RECOVERY_TIMEOUT_S = 180.0  # for Serve to replace a replica or reach a replica count
ROOT = Path(__file__).resolve().parents[2]  # the repository


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(args: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """The Serve application config: ``serve_app:build_app`` with ``args``, N Workers."""
    return {"name": APP, "route_prefix": "/", "import_path": "serve_app:build_app",
            "args": args, "deployments": [{"name": "Worker", "num_replicas": num_workers}]}


class LocalApp:
    """One local Ray cluster with the app deployed; ``close()`` shuts everything down."""

    def __init__(self, app_args: dict[str, Any], num_workers: int, num_cpus: int = 8) -> None:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
        import ray
        from ray import serve

        from serve_app.cluster.ingress import prepare_cluster_env
        from serve_app.config import AppConfig

        prepare_cluster_env()  # what `serve run` gets from build_app: the app's ingress
        self.args = app_args
        if not app_args.get("model"):  # build the default model once here, not in each Worker
            from engine.models.default_model import default_model_path

            default_model_path()
        self.cfg = AppConfig.model_validate(app_args)  # fails here, not in the controller
        self.num_workers = num_workers
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.temp_dir = tempfile.mkdtemp(prefix="soak-ray-", dir="/tmp")
        ray.init(address="local", num_cpus=num_cpus, _temp_dir=self.temp_dir,
                 include_dashboard=False, log_to_driver=False)
        try:
            port = free_port()
            self.http = {"host": "127.0.0.1", "port": port}
            serve.start(http_options=self.http)
            self.url = f"http://127.0.0.1:{port}"
            self._deploy(num_workers)
            if wait_for(lambda: self.status() == "RUNNING", 600, 1.0) is None:
                raise RuntimeError(f"the soak app did not start: {serve.status()}")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        import ray
        from ray import serve

        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    # ---- replicas ------------------------------------------------------------------------

    def replica_actors(self, deployment: str) -> list[tuple[str, int]]:
        """(replica id, pid) of the live replica actors of ``deployment``, from the GCS actor
        table (``ray.util.state`` would need the dashboard, which the soak does not start)."""
        from ray._private.state import actors

        cls = f"ServeReplica:{APP}:{deployment}"
        return [(a["Name"].rsplit("#", 1)[-1], a["Pid"])
                for a in actors(actor_state_name="ALIVE").values()
                if a["ActorClassName"] == cls]

    def replica_states(self, deployment: str) -> dict[str, int]:
        from ray import serve

        app = serve.status().applications.get(APP)
        if app is None or deployment not in app.deployments:
            return {}
        states = app.deployments[deployment].replica_states
        return {str(getattr(k, "value", k)): v for k, v in states.items()}

    def settled(self, deployment: str, target: int, gone_pid: int | None = None) -> bool:
        """``target`` replicas RUNNING, none other, and ``gone_pid`` no longer among them."""
        actors = self.replica_actors(deployment)
        if len(actors) != target or any(pid == gone_pid for _, pid in actors):
            return False
        return self.replica_states(deployment) == {"RUNNING": target}

    def kill(self, deployment: str, replica: str | None = None) -> tuple[str, int]:
        """SIGKILL the process of replica ``replica`` of ``deployment`` (default: the first);
        returns its (replica id, pid)."""
        actors = sorted(self.replica_actors(deployment))
        replica, pid = next((a for a in actors if a[0] == replica), actors[0])
        os.kill(pid, signal.SIGKILL)
        return replica, pid

    def _deploy(self, num_workers: int) -> None:
        from ray.serve.context import _get_global_client
        from ray.serve.schema import ServeDeploySchema

        config = ServeDeploySchema.model_validate(
            {"http_options": self.http,
             "applications": [app_config(self.args, num_workers)]})
        _get_global_client().deploy_apps(config, _blocking=False)

    def status(self) -> str:
        from ray import serve

        app = serve.status().applications.get(APP)
        return "" if app is None else str(getattr(app.status, "value", app.status))

    def scale(self, num_workers: int) -> None:
        """Change the Worker replica count in place (returns once Serve accepted it)."""
        self._deploy(num_workers)
        self.num_workers = num_workers

    # ---- what the invariants read ----------------------------------------------------------

    def rss_bytes(self) -> dict[str, int]:
        """Resident memory of every live replica process, keyed ``Deployment/replica``."""
        out = {}
        for deployment in ("Router", "Worker"):
            for replica, pid in self.replica_actors(deployment):
                rss = process_rss(pid)
                if rss is not None:
                    out[f"{deployment}/{replica}"] = rss
        return out

    def retried_requests(self) -> int:
        """Requests the Routers sent again after their Worker died (from the Router logs)."""
        total = 0
        for path in (Path(self.temp_dir) / "session_latest" / "logs").rglob("*Router*"):
            text = path.read_text(errors="replace") if path.is_file() else ""
            total += sum(int(n) for n in re.findall(r"retrying (\d+) requests", text))
        return total

    def find_in_logs(self, needles: list[str]) -> list[str]:
        """Log files of this cluster's session that contain any of ``needles``."""
        logs = Path(self.temp_dir) / "session_latest" / "logs"
        hits = []
        for path in logs.rglob("*"):
            if not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if any(n.encode() in data for n in needles):
                hits.append(str(path.relative_to(logs)))
        return hits


def write_key_file(key: str) -> str:
    """The API key in a file only this user can read (``api_key_file``)."""
    fd, path = tempfile.mkstemp(prefix="soak-key-")
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return path


def process_rss(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes (Linux ``/proc``); None if unreadable."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def wait_for(check: Any, timeout_s: float, interval_s: float = 0.5) -> float | None:
    """Poll ``check()`` (exceptions count as False); seconds it took, or None on timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if check():
                return time.monotonic() - start
        except Exception:
            pass
        time.sleep(interval_s)
    return None
