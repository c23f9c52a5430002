"""Ray and Serve around the deployments: the ingress (HAProxy on loopback, the cluster's
environment), the request router that picks a Worker replica, and the per-process registry of
known replicas. May import ``serve_app.wire``; nothing above it."""
