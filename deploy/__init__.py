"""Deployment assets of pagedserve: the Serve config, the Dockerfile, autoscaling policies, the
Grafana dashboard and its provisioning (``python -m deploy.grafana``), the Prometheus config."""
