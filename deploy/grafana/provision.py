"""Upload the pagedserve dashboard and its Prometheus data source to Grafana, idempotently.

Both are keyed by a fixed uid: a missing one is created, a different one is updated in place, an
equal one is left alone (so running it twice creates no new dashboard version). Failures become
a ``ProvisionError`` whose message says what to fix: Grafana unreachable, the token refused (401)
or lacking a permission (403), a name taken by another data source (409).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import niquests
from grafana_client import GrafanaApi
from grafana_client.client import (
    GrafanaClientError,
    GrafanaException,
    GrafanaUnauthorizedError,
)

from deploy.grafana.dashboard import DATASOURCE_NAME, DATASOURCE_UID, UID, dashboard_json
from serve_app.metrics.names import MetricsNaming

DEFAULT_PROMETHEUS_URL = "http://localhost:9090"
SCRAPE_INTERVAL = "10s"  # as in deploy/prometheus/prometheus.yml: Grafana's $__rate_interval base


class ProvisionError(RuntimeError):
    """Provisioning failed; the message names the cause and the fix."""


@dataclass
class ProvisionResult:
    datasource: str  # "created" | "updated" | "unchanged"
    dashboard: str
    dashboard_url: str


def datasource_model(prometheus_url: str) -> dict[str, Any]:
    return {"uid": DATASOURCE_UID, "name": DATASOURCE_NAME, "type": "prometheus",
            "access": "proxy", "url": prometheus_url, "isDefault": False,
            "jsonData": {"httpMethod": "POST", "timeInterval": SCRAPE_INTERVAL}}


def provision(url: str, token: str, prometheus_url: str = DEFAULT_PROMETHEUS_URL,
              folder_uid: str | None = None, timeout_s: float = 10.0,
              metrics_naming: MetricsNaming = "pagedserve") -> ProvisionResult:
    """Create or update the data source, then the dashboard (for the series as the app's
    ``metrics_naming`` spells them), in the Grafana at ``url``."""
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_s)
    try:
        ds = _upsert_datasource(api, datasource_model(prometheus_url))
        dash, dash_url = _upsert_dashboard(api, dashboard_json(metrics_naming), folder_uid)
    except GrafanaUnauthorizedError:
        raise ProvisionError(f"Grafana at {url} refused the token (401 Unauthorized): pass a "
                             "valid service-account token with --token") from None
    except GrafanaClientError as e:
        raise ProvisionError(_client_error(url, e)) from None
    except (niquests.exceptions.RequestException, GrafanaException) as e:
        raise ProvisionError(f"cannot reach Grafana at {url}: {_reason(e)} (is it running, "
                             "and is the URL right?)") from None
    return ProvisionResult(ds, dash, f"{url.rstrip('/')}{dash_url}")


def _upsert_datasource(api: GrafanaApi, model: dict[str, Any]) -> str:
    current = _get_or_none(api.datasource.get_datasource_by_uid, model["uid"])
    if current is None:
        api.datasource.create_datasource(model)
        return "created"
    if all(current.get(k) == v for k, v in model.items() if k != "jsonData") and \
            all((current.get("jsonData") or {}).get(k) == v for k, v in model["jsonData"].items()):
        return "unchanged"
    api.datasource.update_datasource_by_uid(model["uid"], model)
    return "updated"


def _upsert_dashboard(api: GrafanaApi, model: dict[str, Any],
                      folder_uid: str | None) -> tuple[str, str]:
    current = _get_or_none(api.dashboard.get_dashboard, UID)
    if current is not None and _same(current.get("dashboard") or {}, model) and \
            (folder_uid is None or current.get("meta", {}).get("folderUid") == folder_uid):
        return "unchanged", current.get("meta", {}).get("url", f"/d/{UID}")
    body: dict[str, Any] = {"dashboard": {**model, "id": None}, "overwrite": True,
                            "message": "provisioned by python -m deploy.grafana"}
    if folder_uid is not None:
        body["folderUid"] = folder_uid
    answer = api.dashboard.update_dashboard(body) or {}
    return ("created" if current is None else "updated"), answer.get("url", f"/d/{UID}")


def _same(stored: dict[str, Any], model: dict[str, Any]) -> bool:
    """Equal but for what Grafana adds or bumps on save."""
    ignore = {"id", "version"}
    return {k: v for k, v in stored.items() if k not in ignore} == \
        {k: v for k, v in model.items() if k not in ignore}


def _get_or_none(get: Any, uid: str) -> dict[str, Any] | None:
    try:
        return get(uid)
    except GrafanaClientError as e:
        if e.status_code == 404:
            return None
        raise


def _client_error(url: str, e: GrafanaClientError) -> str:
    if e.status_code == 403:
        return (f"Grafana at {url} accepted the token but denied the change (403 Forbidden): "
                "the service account needs the Admin role to manage data sources")
    if e.status_code == 409:
        return (f"Grafana at {url} already has a data source named {DATASOURCE_NAME!r} with "
                f"another uid (409 Conflict): rename or delete it, then run again")
    return f"Grafana at {url} rejected a request: {e.message}"


def _reason(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
