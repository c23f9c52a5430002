"""The dashboard's panels and their PromQL: throughput, latency, the scheduler and KV cache,
the Router, and Ray Serve's replicas, each a time series of rates or of histogram quantiles
(never ``_sum / _count``: Ray's exporter estimates a histogram's ``_sum``)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.builders.common import VizLegendOptions
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from serve_app.metrics.names import Naming

RATE = "[$__rate_interval]"
ROUTER = '{model_name=~"$model_name"}'
WORKERS = '{deployment="Worker", application=~"$application"}'
QUANTILES = (0.5, 0.9, 0.99)

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")  # the data-source variable


_naming = Naming()  # the spelling the panels below are built for (``use_naming`` sets it)


def use_naming(naming: Naming) -> None:
    """Build the panels for the series as ``naming`` spells them."""
    global _naming
    _naming = naming


def m(name: str) -> str:
    """The exported name of a pagedserve metric in the naming being built."""
    return _naming.exported(name)


def replica() -> str:
    """The label that holds a series' replica id in the naming being built."""
    return _naming.replica_label


def engine() -> str:
    """The selector of a Worker's series."""
    return f'{{model_name=~"$model_name", {replica()}=~"$replica"}}'


# ---- queries ------------------------------------------------------------------------------------

def rate(metric: str, selector: str, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{selector}{RATE}))"


def quantile(q: float, metric: str, selector: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{selector}{RATE})))"


def quantile_targets(metric: str, selector: str) -> list[tuple[str, str]]:
    return [(quantile(q, metric, selector), f"p{round(q * 100)}") for q in QUANTILES]


# ---- panels -------------------------------------------------------------------------------------

def panel(title: str, targets: list[tuple[str, str]], unit: str = "short", width: int = 8,
          description: str = "", max_val: float | None = None) -> timeseries.Panel:
    p = (timeseries.Panel().title(title).description(description).unit(unit).min(0)
         .datasource(DS).span(width).height(8).fill_opacity(10).line_width(1)
         .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST)
                 .placement(LegendPlacement.BOTTOM).show_legend(True)))
    if max_val is not None:
        p = p.max(max_val)
    for i, (expr, legend) in enumerate(targets):
        p = p.with_target(prometheus.Dataquery().expr(expr).legend_format(legend)
                          .ref_id(chr(ord("A") + i)).datasource(DS))
    return p


def throughput_panels() -> list[timeseries.Panel]:
    return [
        panel("Tokens / s", [(rate(m("prompt_tokens_total"), engine(), "model_name"),
                              "prompt {{model_name}}"),
                             (rate(m("generation_tokens_total"), engine(), "model_name"),
                              "generation {{model_name}}")],
              description="Prompt tokens added and tokens generated per second."),
        panel("Finished requests / s", [(rate(m("request_success_total"), engine(),
                                              "finished_reason"), "{{finished_reason}}")],
              unit="reqps", description="By finish reason: stop, length, abort."),
        panel("HTTP responses / s", [(rate(m("http_requests_total"), ROUTER, "status"),
                                      "{{status}}")],
              unit="reqps", description="Router responses by status code."),
    ]


def latency_panels() -> list[timeseries.Panel]:
    specs = [("Inter-token latency", "inter_token_latency_seconds"),
             ("Time per output token", "request_time_per_output_token_seconds"),
             ("End-to-end latency", "e2e_request_latency_seconds"),
             ("Queue time", "request_queue_time_seconds"),
             ("Engine time to first token", "engine_time_to_first_token_seconds")]
    return [panel("Time to first token",
                  quantile_targets(m("time_to_first_token_seconds"), ROUTER), unit="s",
                  width=4, description="From arrival at the HTTP server (the Router).")] + [
        panel(title, quantile_targets(m(name), engine()), unit="s", width=4)
        for title, name in specs]


def engine_panels() -> list[timeseries.Panel]:
    hits = rate(m("prefix_cache_hits_total"), engine())
    queries = rate(m("prefix_cache_queries_total"), engine())
    return [
        panel("Requests running and waiting",
              [(f'sum by ({replica()}) ({m("num_requests_running")}{engine()})',
                f"running {{{{{replica()}}}}}"),
               (f'sum by ({replica()}) ({m("num_requests_waiting")}{engine()})',
                f"waiting {{{{{replica()}}}}}")]),
        panel("KV-cache usage", [(f'max by ({replica()}) ({m("kv_cache_usage_perc")}{engine()})',
                                  f"{{{{{replica()}}}}}")], unit="percentunit", max_val=1),
        panel("Prefix-cache hit rate", [(f"{hits} / {queries}", "hit rate")],
              unit="percentunit", max_val=1,
              description="Prompt tokens found in the prefix cache / prompt tokens looked up."),
        panel("Preemptions / s", [(rate(m("num_preemptions_total"), engine(), replica()),
                                   f"{{{{{replica()}}}}}")]),
        panel("Engine step time", quantile_targets(m("iteration_duration_seconds"), engine()),
              unit="s"),
        panel("Tokens per step", quantile_targets(m("iteration_tokens_total"), engine()),
              description="Prefill and decode tokens computed in one engine step."),
    ]


def router_panels() -> list[timeseries.Panel]:
    return [
        panel("Router batch size", quantile_targets(m("router_batch_size"), ROUTER),
              description="Requests per batch sent to a Worker."),
        panel("Batches / s", [(rate(m("router_batch_size_count"), ROUTER, replica()),
                               f"{{{{{replica()}}}}}")], unit="reqps"),
        panel("Rejected (429) / s", [(rate(m("router_requests_rejected_total"), ROUTER, "cause"),
                                      "{{cause}}")], unit="reqps",
              description="Requests refused with 429, by cause."),
    ]


def serve_panels() -> list[timeseries.Panel]:
    return [
        panel("Worker replicas",
              [(f"sum by (application) (ray_serve_deployment_replica_healthy{WORKERS})",
                "healthy {{application}}"),
               (f"max by (application) (ray_serve_autoscaling_target_replicas{WORKERS})",
                "target {{application}}"),
               (f"max by (application) (ray_serve_autoscaling_desired_replicas{WORKERS})",
                "policy decision {{application}}")],
              width=12, description="Healthy replicas, Serve's target, and the autoscaling "
              "policy's raw decision before min/max bounds."),
        panel("Autoscaling input",
              [(f"max by (application) (ray_serve_autoscaling_total_requests{WORKERS})",
                "requests seen {{application}}")],
              width=12, description="The load the autoscaler saw at its last decision."),
    ]
