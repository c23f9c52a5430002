"""Worker autoscaling: the queue-depth policy Serve calls (``policy``), its estimators and
signals, and the YAML policy files' schema (``config``). Plain Python: imports nothing else of
serve_app or the engine."""
