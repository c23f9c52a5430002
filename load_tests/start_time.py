"""Replica start time, end to end: from the autoscaling policy's scale-up decision to the first
token served by the new Worker, and where the time goes (#53).

For each model, in one invocation: ``serve run serve_app:build_app`` with a policy that allows
two Workers (min 1, max 2, no upscale delay), then streams enough requests that the policy asks
for a second Worker. It reads:

* the decision: the policy's ``QueueDepthPolicy: up 1 -> 2`` line in Serve's controller log,
  and the controller's ``Adding 1 replica`` / ``Starting Replica`` lines (actor creation);
* the new replica's own timestamps (``Worker.start_phases()``, ``serve_app.worker.startup``): process
  start, start of its imports, the engine's build and its phases (config and tokenizer, model,
  weight load, pack, warm-up, KV allocation, CUDA graphs);
* the first token it served: the first streamed response whose ``x-pagedserve-replica`` header
  names it, timed at its first chunk.

Prints one JSON line per model (times in seconds). Run it under the Ray lock on a shared
machine: ``flock /tmp/pagedserve-ray.lock .venv/bin/python load_tests/start_time.py``.
``--engine-only`` builds the engine in this process instead (no Ray): its phases and the first
and second request's time to first token, to see whether a warm-up would pay.

The settings are the README's (``serve run`` defaults: threads, CPU reservations as
``build_app`` fits them to ``max_replicas`` Workers) but for ``max_num_seqs`` (2 by default
here), which only makes a queue build so that the policy scales. ``serve run`` runs in its own
session; every process left in that session (Ray's GCS, raylet, workers, HAProxy) is killed when
the measurement ends, fails, or this script gets SIGTERM (``timeout``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

URL = "http://127.0.0.1:8000"
REPLICA_HEADER = "x-pagedserve-replica"  # serve_app.router.router.REPLICA_HEADER
POLICY = {"min_replicas": 1, "max_replicas": 2, "target_queue_per_replica": 1,
          "max_kv_usage": 0.9, "upscale_delay_s": 0, "downscale_delay_s": 600,
          "look_back_period_s": 10, "metrics_interval_s": 0.5}
LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def model_path(name: str) -> str | None:
    """None for the app's default model; the benchmark checkpoint of that size otherwise."""
    if name == "default":
        return None
    from load_tests.offline_throughput import checkpoint_path
    return str(checkpoint_path(name))


# ----------------------------------------------------------------------------- serve run
def start_app(model: str | None, policy_file: Path, max_num_seqs: int, worker_cpus: float,
              log: Path) -> subprocess.Popen[bytes]:
    args = [str(REPO / ".venv/bin/serve"), "run", "serve_app:build_app",
            f"autoscaling={policy_file}", f"max_num_seqs={max_num_seqs}"]
    if worker_cpus > 0:
        args.append(f"worker_num_cpus={worker_cpus}")
    if model:
        args.append(f"model={model}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """serve run gets SIGKILL when this script dies, however it dies (Ray's own processes
    share serve run's fate the same way)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _exit_on_sigterm() -> None:
    """timeout(1)'s SIGTERM unwinds through measure_serve's finally, which stops serve run
    (set again after ray.init, whose core installs its own handler)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (``serve run`` and what it started, Ray's included:
    Ray does not start new sessions)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6: session
            pids.append(int(stat.parent.name))
    return pids


def stop_app(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to ``serve run`` (it shuts Serve and Ray down), then SIGKILL to whatever of its
    session is left after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    for _ in range(3):
        left = [pid for pid in session_pids(proc.pid) if pid != os.getpid()]
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(1)
    proc.poll()


def wait_for(check, timeout_s: float, what: str, proc: subprocess.Popen[bytes] | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"serve run exited ({proc.returncode}) while waiting for {what}")
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no {what} within {timeout_s:.0f}s")


def workers() -> list[str]:
    stats = httpx.get(f"{URL}/v1/stats", timeout=10).json()
    return [w["replica"] for w in stats["workers"]]


class Load:
    """``streams`` threads streaming completions back to back; notes, per replica, the wall
    time of the first chunk of the first response it served."""

    def __init__(self, streams: int, max_tokens: int) -> None:
        self.first_token: dict[str, float] = {}
        self._stop = threading.Event()
        self._max_tokens = max_tokens
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(streams)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        body = {"prompt": f"stream {i} says", "max_tokens": self._max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                try:
                    with client.stream("POST", f"{URL}/v1/completions", json=body) as resp:
                        replica = resp.headers.get(REPLICA_HEADER, "")
                        for n, _ in enumerate(resp.iter_lines()):
                            if n == 0:
                                self.first_token.setdefault(replica, time.time())
                except httpx.HTTPError:
                    time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


# ----------------------------------------------------------------------------- Ray's side
def controller_events(logs: Path, new_replica: str) -> dict[str, float]:
    """Wall times of the policy's last 'up' line before the new replica's start, and the
    controller's 'Adding' and 'Starting Replica' lines for it."""
    events: dict[str, float] = {}
    for path in sorted((logs / "serve").glob("controller_*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = LOG_TIME.search(line)
            if not m:
                continue
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if "QueueDepthPolicy: up" in line and "starting" not in events:
                events["decision"] = t  # the last 'up' before the replica starts
            elif "Adding 1 replica" in line and "Worker" in line and "starting" not in events:
                events["adding"] = t
            elif "Starting Replica" in line and new_replica in line:
                events.setdefault("starting", t)
    return events


def gcs_address(proc: subprocess.Popen[bytes]) -> str:
    """The GCS address of the cluster ``serve run`` started (its processes' ``--gcs-address``)."""
    for pid in session_pids(proc.pid):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(b"--gcs-address="):
                return arg.split(b"=", 1)[1].decode()
    raise RuntimeError("no --gcs-address among serve run's processes")


def replica_phases(replica: str, address: str) -> dict:
    from serve_app.cluster.ingress import stay_on_loopback

    stay_on_loopback(os.environ)  # as serve run: else Ray dials the machine's external address
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # serve run's cluster wants its token
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        _exit_on_sigterm()
    handle = serve.get_deployment_handle("Worker", app_name="default")
    return handle.start_phases.remote(target_replica=replica).result(timeout_s=60)


def logs_dir() -> Path:
    import ray
    return Path(ray._private.worker._global_node.get_logs_dir_path())


def breakdown(ev: dict[str, float], p: dict, first_token: float) -> dict[str, float | None]:
    """Seconds per phase, in order; they add up to ``total``."""
    def gap(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round(b - a, 3)

    eng = p["engine"]
    out: dict[str, float | None] = {
        "decision_to_actor_creation": gap(ev.get("decision"), ev.get("starting")),
        "ray_placement_process_start": gap(ev.get("starting"), p["process_start"]),
        "ray_worker_and_replica_boot": gap(p["process_start"], p["imports_start"]),
        "imports": gap(p["imports_start"], p["engine_start"]),
    }
    out.update({f"engine_{k}": v for k, v in eng.items()})
    out["ready_to_first_token"] = gap(p["engine_end"], first_token)
    out["total"] = gap(ev.get("decision"), first_token)
    return out


def measure_serve(name: str, max_num_seqs: int, worker_cpus: float, streams: int,
                  max_tokens: int, timeout_s: float) -> dict:
    model = model_path(name)
    tmp = Path(tempfile.mkdtemp(prefix="start-time-"))
    policy = tmp / "policy.yaml"
    policy.write_text("".join(f"{k}: {v}\n" for k, v in POLICY.items()))
    proc = start_app(model, policy, max_num_seqs, worker_cpus, tmp / "serve_run.log")
    try:
        wait_for(lambda: httpx.get(f"{URL}/health", timeout=5).status_code == 200, timeout_s,
                 "healthy app", proc)
        first = wait_for(workers, timeout_s, "a Worker", proc)
        load = Load(streams, max_tokens)
        new = wait_for(lambda: [r for r in load.first_token if r and r not in first],
                       timeout_s, "a token from a second Worker", proc)[0]
        first_token = load.first_token[new]
        load.stop()
        phases = replica_phases(new, gcs_address(proc))
        events = controller_events(logs_dir(), new)
        return {"model": name, "mode": "serve run", "new_replica": new,
                "breakdown": breakdown(events, phases, first_token),
                "events": events, "replica": phases}
    finally:
        import ray
        if ray.is_initialized():
            ray.shutdown()
            from ray.serve import context
            context._set_global_client(None)  # the next model's cluster is another
            _exit_on_sigterm()
        stop_app(proc)
        print(f"serve run log: {tmp / 'serve_run.log'}", file=sys.stderr)


# ----------------------------------------------------------------------------- in-process
def measure_engine(name: str) -> dict:
    """The engine built here as a Worker builds it; its phases, and the first and second
    request's time to first token (greedy, 16-token prompt)."""
    import asyncio
    import importlib.util

    t0 = time.perf_counter()
    from engine.core.sampling_params import SamplingParams
    if importlib.util.find_spec("ray") is not None:
        from serve_app.config import AppConfig
        from serve_app.worker.worker import build_engine
    else:  # a GPU image without Ray (gpu_check): the engine as a GPU Worker builds it
        from engine.async_engine import AsyncEngine
    imports = time.perf_counter() - t0
    model = model_path(name)
    t1 = time.perf_counter()
    if importlib.util.find_spec("ray") is not None:
        engine = build_engine(AppConfig.model_validate({"model": model} if model else {}))
    else:
        engine = AsyncEngine(**({"model": model} if model else {}))
    build = time.perf_counter() - t1

    async def ttft(i: int) -> float:
        start = time.perf_counter()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in engine.generate(f"r{i}", list(range(10 + i, 26 + i)), params):
            break
        return time.perf_counter() - start

    first = [round(asyncio.run(ttft(i)), 4) for i in range(3)]
    engine.shutdown()
    return {"model": name, "mode": "engine", "device": str(engine.engine.device),
            "imports": round(imports, 3),
            "build": round(build, 3), "engine": engine.engine.start_clock.phases,
            "ttft_first_second_third": first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,0.5b",
                    help="comma-separated: default, 0.5b, tiny (offline_throughput's shapes)")
    ap.add_argument("--engine-only", action="store_true",
                    help="build the engine in this process (no Ray)")
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--worker-num-cpus", type=float, default=0,
                    help="the Workers' CPU reservation (0: the app's own, fitted by build_app)")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300)
    args = ap.parse_args()
    _exit_on_sigterm()
    rc = 0
    for name in args.models.split(","):
        try:
            result = (measure_engine(name) if args.engine_only else
                      measure_serve(name, args.max_num_seqs, args.worker_num_cpus,
                                    args.streams, args.max_tokens, args.timeout))
        except Exception as exc:  # noqa: BLE001 - one model's failure; the next still runs
            result, rc = {"model": name, "error": f"{type(exc).__name__}: {exc}"}, 1
        print(json.dumps(result), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
