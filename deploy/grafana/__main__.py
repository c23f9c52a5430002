"""``python -m deploy.grafana --url URL --token TOKEN``: upload the dashboard and its Prometheus
data source to Grafana (idempotent). Exit status 1 with a one-line reason on failure."""

from __future__ import annotations

import argparse
import os
import sys

from deploy.grafana.provision import DEFAULT_PROMETHEUS_URL, ProvisionError, provision


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m deploy.grafana", description=__doc__)
    p.add_argument("--url", default=os.environ.get("GRAFANA_URL"),
                   help="Grafana's base URL, e.g. http://grafana:3000 (default: $GRAFANA_URL)")
    p.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                   help="a Grafana service-account token with the Admin role "
                        "(default: $GRAFANA_TOKEN)")
    p.add_argument("--prometheus-url", default=DEFAULT_PROMETHEUS_URL,
                   help="the Prometheus that scrapes Ray, as Grafana's server reaches it "
                        f"(default: {DEFAULT_PROMETHEUS_URL})")
    p.add_argument("--folder-uid", default=None,
                   help="the uid of an existing folder to put the dashboard in (default: General)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    p.add_argument("--metrics-naming", choices=["pagedserve", "vllm"], default="pagedserve",
                   help="the app's metrics_naming: which names the dashboard queries")
    args = p.parse_args(argv)
    if not args.url or not args.token:
        p.error("--url and --token are required (or set GRAFANA_URL and GRAFANA_TOKEN)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = provision(args.url, args.token, args.prometheus_url, args.folder_uid,
                           args.timeout, args.metrics_naming)
    except ProvisionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"data source: {result.datasource}; dashboard: {result.dashboard}; "
          f"{result.dashboard_url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
