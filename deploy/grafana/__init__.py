"""The pagedserve Grafana dashboard (``dashboard.py``, built as code) and its provisioning
(``provision.py``; ``python -m deploy.grafana --url URL --token TOKEN``)."""
