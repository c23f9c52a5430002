"""The Grafana dashboard and ``python -m deploy.grafana``, without Ray.

Provisioning runs against a stand-in for Grafana's HTTP API (the endpoints the script uses, with
bearer-token auth and Grafana's status codes): created once, unchanged on a second run, updated
when it differs; an unreachable server, a bad token, a forbidden change and a name conflict each
exit 1 with a one-line reason.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.grafana import dashboard
from deploy.grafana.__main__ import main
from deploy.grafana.provision import datasource_model
from tests.serve.test_worker_metrics import recorded  # noqa: F401  (Ray's metric classes, stubbed)

from .cluster import ROOT, free_port

TOKEN = "glsa_test_token"


class FakeGrafana(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.datasources: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.writes: list[str] = []  # "METHOD path" of every change
        self.forbid_writes = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def log_message(self, *args) -> None:
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._reply(401, {"message": "invalid API key"})
            return False
        return True

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def do_GET(self) -> None:
        if not self._authorized():
            return
        g, path = self.server, self.path
        if path.startswith("/api/datasources/uid/"):
            ds = g.datasources.get(path.rsplit("/", 1)[1])
            if ds is None:
                self._reply(404, {"message": "Data source not found"})
            else:
                self._reply(200, {"id": 1, "orgId": 1, "readOnly": False, **ds})
        elif path.startswith("/api/dashboards/uid/"):
            d = g.dashboards.get(path.rsplit("/", 1)[1])
            if d is None:
                self._reply(404, {"message": "Dashboard not found"})
            else:
                self._reply(200, {"dashboard": d, "meta": {"url": f"/d/{d['uid']}/x",
                                                           "folderUid": ""}})
        else:
            self._reply(404, {"message": "Not found"})

    def _write(self) -> bool:
        self.server.writes.append(f"{self.command} {self.path}")
        if self.server.forbid_writes:
            self._reply(403, {"message": "Permissions needed: datasources:create"})
            return False
        return True

    def do_POST(self) -> None:
        if not self._authorized() or not self._write():
            return
        g, body = self.server, self._body()
        if self.path == "/api/datasources":
            if any(d["name"] == body["name"] for d in g.datasources.values()):
                self._reply(409, {"message": "data source with the same name already exists"})
                return
            g.datasources[body["uid"]] = body
            self._reply(200, {"message": "Datasource added", "datasource": body})
        elif self.path == "/api/dashboards/db":
            d = body["dashboard"]
            version = g.dashboards.get(d["uid"], {}).get("version", 0) + 1
            g.dashboards[d["uid"]] = {**d, "id": 7, "version": version}
            self._reply(200, {"status": "success", "uid": d["uid"], "version": version,
                              "url": f"/d/{d['uid']}/pagedserve"})
        else:
            self._reply(404, {"message": "Not found"})

    def do_PUT(self) -> None:
        if not self._authorized() or not self._write():
            return
        uid = self.path.rsplit("/", 1)[1]
        self.server.datasources[uid] = self._body()
        self._reply(200, {"message": "Datasource updated"})


@pytest.fixture
def grafana():
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _run(url: str, token: str = TOKEN, *extra: str) -> int:
    return main(["--url", url, "--token", token, "--prometheus-url", "http://prom:9090",
                 "--timeout", "5", *extra])


def test_creates_then_leaves_alone_then_updates(grafana, capsys):
    assert _run(grafana.url) == 0
    assert "data source: created; dashboard: created" in capsys.readouterr().out
    assert grafana.writes == ["POST /api/datasources", "POST /api/dashboards/db"]
    assert grafana.datasources["pagedserve-prometheus"] == datasource_model("http://prom:9090")
    stored = grafana.dashboards["pagedserve"]
    assert stored["panels"] == dashboard.dashboard_json()["panels"]

    assert _run(grafana.url) == 0  # idempotent: nothing written, no new dashboard version
    assert "data source: unchanged; dashboard: unchanged" in capsys.readouterr().out
    assert len(grafana.writes) == 2 and grafana.dashboards["pagedserve"]["version"] == 1

    grafana.dashboards["pagedserve"]["title"] = "edited by hand"
    assert main(["--url", grafana.url, "--token", TOKEN, "--prometheus-url",
                 "http://other:9090"]) == 0
    assert "data source: updated; dashboard: updated" in capsys.readouterr().out
    assert grafana.writes[2:] == ["PUT /api/datasources/uid/pagedserve-prometheus",
                                  "POST /api/dashboards/db"]
    assert grafana.dashboards["pagedserve"]["title"] == dashboard.TITLE


def test_bad_token_says_so(grafana, capsys):
    assert _run(grafana.url, "wrong") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "refused the token (401" in err and "--token" in err
    assert grafana.writes == []


def test_unreachable_grafana_says_so(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert _run(url) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot reach Grafana at {url}") and err.count("\n") == 1


def test_forbidden_and_name_conflict_say_so(grafana, capsys):
    grafana.forbid_writes = True
    assert _run(grafana.url) == 1
    assert "403 Forbidden" in capsys.readouterr().err
    grafana.forbid_writes = False
    grafana.datasources["someone-else"] = {"uid": "someone-else",
                                           "name": dashboard.DATASOURCE_NAME}
    assert _run(grafana.url) == 1
    assert "409 Conflict" in capsys.readouterr().err


def test_cli_needs_url_and_token():
    proc = subprocess.run([sys.executable, "-m", "deploy.grafana"], cwd=ROOT, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode == 2 and "--url and --token are required" in proc.stderr


def test_committed_json_is_the_generated_one():
    assert dashboard.JSON_PATH.read_text() == dashboard.render(), \
        "deploy/grafana/pagedserve.json is stale: run python -m deploy.grafana.dashboard"


def test_dashboard_shape():
    model = dashboard.dashboard_json()
    assert model["uid"] == "pagedserve"
    names = [v["name"] for v in model["templating"]["list"]]
    assert names == ["datasource", "model_name", "replica", "application"]
    titles = [p["title"] for p in model["panels"]]
    for title in ("Time to first token", "Inter-token latency", "End-to-end latency",
                  "KV-cache usage", "Prefix-cache hit rate", "Preemptions / s",
                  "Router batch size", "Worker replicas", "Rejected (429) / s"):
        assert title in titles
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    for p in model["panels"]:
        for t in p.get("targets") or []:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_vllm_naming_dashboard_reads_only_series_that_naming_exports(recorded):  # noqa: F811
    """Built for ``metrics_naming: vllm``, every pagedserve series the dashboard queries is one
    the Worker and Router metrics create under that naming (the pagedserve naming is checked
    against a live scrape in ``test_metrics.py``), and replicas are selected by ``ReplicaId``."""
    from serve_app.metrics import router as router_metrics
    from serve_app.metrics import worker as metrics
    from serve_app.metrics.names import Naming
    from tests.serve.test_worker_metrics import FakeEngine

    naming = Naming("vllm")
    metrics.WorkerMetrics(FakeEngine(), "m", "r", naming=naming)
    router_metrics.RouterMetrics("m", "r", naming)
    exported = {naming.exported(n.removeprefix("pagedserve_")) if n.startswith("pagedserve_")
                else naming.exported(_vllm_key(n)) for n in recorded}
    series = {re.sub(r"_(bucket|count)$", "", name)
              for expr in dashboard.expressions(dashboard.dashboard_json("vllm"))
              for name in re.findall(r"\bray_\w+", expr) if not name.startswith("ray_serve_")}
    assert series and series <= exported, series - exported
    assert any(s.startswith("ray_vllm_") for s in series)
    variables = {v["name"]: v["query"] for v in dashboard.dashboard_json("vllm")["templating"]["list"]
                 if v["type"] == "query"}
    assert variables["replica"].endswith(", ReplicaId)")
    assert dashboard.dashboard_json() != dashboard.dashboard_json("vllm")


def _vllm_key(name):
    from serve_app.metrics.names import VLLM_NAMES

    return next(k for k, v in VLLM_NAMES.items() if "vllm_" + v == name)
