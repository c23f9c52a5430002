"""``build_app``: validated ``AppConfig`` -> the Router + Worker Serve application.

No ``from __future__ import annotations`` here: Serve reads ``build_app``'s parameter annotation
to validate ``serve run serve_app:build_app key=value ...`` arguments into ``AppConfig``.
"""

import logging
import math
from typing import Any, cast

from ray import serve
from ray.serve import Application, Deployment
from ray.serve.config import RequestRouterConfig

from serve_app.cluster.ingress import local_cluster_cpus, prepare_cluster_env
from serve_app.cluster.request_router import WorkerRequestRouter
from serve_app.config import AppConfig
from serve_app.router.router import Router
from serve_app.worker.worker import Worker

logger = logging.getLogger("ray.serve")


def build_app(args: AppConfig) -> Application:
    """The application for ``args`` (an ``AppConfig`` or a dict of its fields).

    Before Ray runs in this process (``serve run`` builds the app, then starts the cluster),
    this also sets the environment the cluster will inherit (``prepare_cluster_env``) and fits
    the replicas' CPU reservations to that cluster's CPUs (``fit_reservations``).
    """
    cfg = args if isinstance(args, AppConfig) else AppConfig.model_validate(args or {})
    cpus = local_cluster_cpus()
    if cpus is not None:
        cfg = fit_reservations(cfg, cpus)
    prepare_cluster_env()
    worker = serve.deployment(name="Worker")(Worker).options(**worker_options(cfg))
    # @serve.deployment made Router a Deployment; mypy gives a decorated class its own type
    router = cast(Deployment, Router).options(
        num_replicas=cfg.num_routers, max_ongoing_requests=cfg.router_max_ongoing_requests,
        ray_actor_options=actor_options(cfg, cfg.router_num_cpus))
    return router.bind(worker.bind(cfg), cfg)


def fit_reservations(cfg: AppConfig, cpus: float) -> AppConfig:
    """``cfg`` with its default CPU reservations lowered so that its replicas fit ``cpus``.

    Ray places a replica only where its ``num_cpus`` are free, and a local cluster has as many
    CPUs as the machine has cores: one Worker (1 CPU) and the Router (0.5) never all fit a
    1-core machine, nor two Workers a 2-core one, and ``serve run`` then waits for them
    forever. The reservations are Ray's bookkeeping only (a Worker's threads are its share of
    the cores, ``AppConfig.worker_threads``), so where they do not fit, the defaults give way:
    the Routers take at most a quarter of the CPUs (or what a reservation the user set for the
    Workers leaves) and the Workers' ranks share the rest evenly. Values the user set are kept;
    where they alone cannot fit, a warning says so.
    """
    # every Worker the policy may start must be placeable, or a scale-up waits forever
    workers = cfg.num_workers if cfg.autoscaling is None else cfg.autoscaling.max_replicas
    ranks, routers = workers * cfg.engine.parallel.tensor_parallel_size, cfg.num_routers
    need = ranks * cfg.worker_num_cpus + routers * cfg.router_num_cpus
    if need <= cpus:
        return cfg
    given = cfg.model_fields_set
    router, worker = cfg.router_num_cpus, cfg.worker_num_cpus
    if "router_num_cpus" not in given:
        room = cpus - ranks * worker if "worker_num_cpus" in given else cpus / 4
        router = _ray_units(max(0.0, min(router, room / routers)))
    if "worker_num_cpus" not in given:
        worker = _ray_units((cpus - routers * router) / ranks)
    if worker <= 0 or ranks * worker + routers * router > cpus:
        logger.warning("%d Worker rank(s) x worker_num_cpus=%g and %d Router(s) x "
                       "router_num_cpus=%g reserve %g CPUs, but the local Ray cluster has %g: "
                       "Ray will not place them all and the app will wait for them",
                       ranks, cfg.worker_num_cpus, routers, cfg.router_num_cpus, need, cpus)
        return cfg
    fitted = {"worker_num_cpus": worker, "router_num_cpus": router}
    logger.info("The local Ray cluster has %g CPUs: %s, so that %d Worker rank(s) and %d "
                "Router(s) fit", cpus, ", ".join(f"{k} {getattr(cfg, k):g} -> {v:g}"
                                                 for k, v in fitted.items()
                                                 if v != getattr(cfg, k)), ranks, routers)
    return cfg.model_copy(update=fitted)


def _ray_units(cpus: float) -> float:
    """``cpus`` rounded down to Ray's resolution of a resource (1/10,000)."""
    return math.floor(round(cpus * 1e4, 6)) / 1e4  # 2 - 1.8 is 0.19999...


# Ray Serve reads these in each replica process when it starts (``ray.serve._private.constants``);
# they are the replica half of Serve's throughput-optimized mode, without its direct ingress.
# Safe here because the Router's and Worker's request code is all async (the engine steps in a
# thread of its own), so nothing blocks the replica's main loop for long.
FAST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}


# Also read in each replica process: the largest message a replica's gRPC channel to another
# replica receives. Serve's default, gRPC's 4 MiB, refused a Worker's model_info for a model
# with a 151k-token vocabulary (Qwen2's tokenizer pickles to 5 MB): the Router never learnt the
# model and answered 503 for good. Batches with prompt logprobs can be as large.
REPLICA_ENV = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(1 << 30)}


def actor_options(cfg: AppConfig, num_cpus: float, **resources: Any) -> dict[str, Any]:
    """``ray_actor_options`` of a replica: its resources, and the replica settings."""
    env = {**REPLICA_ENV, **(FAST_PATH_ENV if cfg.serve_fast_path else {})}
    return {"num_cpus": num_cpus, **resources, "runtime_env": {"env_vars": env}}


def worker_options(cfg: AppConfig) -> dict[str, Any]:
    """Deployment options of the Worker: resources per replica and the request router."""
    tp = cfg.engine.parallel.tensor_parallel_size
    cpus = cfg.worker_num_cpus
    # Passed as **router: RequestRouterConfig.__init__ annotates its **kwargs as dict[str, Any]
    # (Ray 2.60), i.e. every argument a dict; its fields are typed on the class.
    router: dict[str, Any] = {
        "request_router_class": WorkerRequestRouter,
        "request_router_kwargs": {
            "prefix_chunk_tokens": cfg.prefix_chunk_tokens,
            "prefix_min_match_tokens": cfg.prefix_min_match_tokens,
            "imbalance_threshold": cfg.imbalance_threshold,
            **standby_kwargs(cfg),
        },
        "request_routing_stats_period_s": cfg.routing_stats_period_s,
    }
    opts: dict[str, Any] = {
        **scaling_options(cfg),
        "max_ongoing_requests": cfg.worker_max_ongoing_requests,
        "health_check_period_s": cfg.health_check_period_s,
        "request_router_config": RequestRouterConfig(**router),
    }
    if cfg.use_gpu():
        opts["ray_actor_options"] = actor_options(cfg, cpus, num_gpus=1)
        bundle = {"CPU": cpus, "GPU": 1}
    else:
        opts["ray_actor_options"] = actor_options(cfg, cpus)
        bundle = {"CPU": cpus}
    if tp > 1:  # one bundle per rank; rank 0 is the replica actor itself
        opts["placement_group_bundles"] = [bundle] * tp
        opts["placement_group_strategy"] = "STRICT_PACK"
    return opts


def standby_kwargs(cfg: AppConfig) -> dict[str, Any]:
    """The request router's standby rule: how many warm Workers the policy keeps unrouted, and
    when an active one is full (the policy's own bounds). Empty without a policy."""
    policy = cfg.autoscaling
    if policy is None:
        return {}
    return {"standby_replicas": policy.standby_replicas,
            "target_queue_per_replica": policy.target_queue_per_replica,
            "max_kv_usage": policy.max_kv_usage}


def scaling_options(cfg: AppConfig) -> dict[str, Any]:
    """How many Workers: ``num_workers``, or the autoscaling policy; and the drain on removal.

    A Worker being removed is first taken out of routing, then Serve waits (polling every
    ``graceful_shutdown_wait_loop_s``) for its ongoing calls, i.e. the batches it streams, up to
    ``graceful_shutdown_timeout_s`` before it calls ``Worker.__del__`` and stops the actor.
    """
    opts: dict[str, Any] = {"graceful_shutdown_wait_loop_s": 0.5,
                            "graceful_shutdown_timeout_s": cfg.worker_drain_timeout_s}
    if cfg.autoscaling is None:
        opts["num_replicas"] = cfg.num_workers
    else:
        opts["autoscaling_config"] = cfg.autoscaling.serve_autoscaling_config()
    return opts
