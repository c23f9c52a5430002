"""Prometheus metrics through ``ray.util.metrics``, named after vLLM's (``names``): the
helpers every deployment uses (``common``), the Worker's engine metrics (``worker``) and the
Router's HTTP and batching metrics (``router``). May import the engine's front door."""
