"""The serving layer's settings without a Ray cluster: config, builder arguments, ingress
switches, the protocol's request models, and the Serve config file against Ray's own schema.

The batcher, response streams, request router and Worker client have files of their own
(``test_batcher.py``, ``test_streams.py``, ``test_request_router.py``,
``test_worker_client.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

import serve_app.app
from serve_app.app import (
    FAST_PATH_ENV,
    REPLICA_ENV,
    build_app,
    fit_reservations,
    worker_options,
)
from serve_app.cluster.ingress import local_cluster_cpus, serve_at_normal_priority, use_fast_ingress
from serve_app.config import AppConfig
from serve_app.protocol.errors import APIError
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest, parse_request

ROOT = Path(__file__).resolve().parents[2]


# ---- configuration ---------------------------------------------------------------------------

def test_cli_strings_are_coerced_and_engine_keys_nested():
    cfg = AppConfig.model_validate({"model": "/m", "dtype": "bfloat16", "max_model_len": "4096",
                                    "num_workers": "2", "max_batch_size": "32",
                                    "batch_wait_ms": "5", "api_key": "s3cret-key"})
    assert cfg.engine.model.model == "/m"
    assert cfg.engine.model.dtype == "bfloat16"
    assert cfg.engine.model.max_model_len == 4096
    assert (cfg.num_workers, cfg.max_batch_size, cfg.batch_wait_ms) == (2, 32, 5.0)
    assert "s3cret-key" not in repr(cfg)  # a SecretStr
    nested = AppConfig.model_validate({"engine": {"cache": {"block_size": 32}}})
    assert nested.engine.cache.block_size == 32


@pytest.mark.parametrize("args, field", [
    ({"num_workers": "0"}, "num_workers"),
    ({"dtype": "int3"}, "dtype"),
    ({"max_batch_size": "many"}, "max_batch_size"),
    ({"no_such_option": 1}, "no_such_option"),
])
def test_bad_builder_argument_is_a_clear_error(args, field):
    with pytest.raises(ValueError, match=field):
        call_user_app_builder_with_args_if_necessary(build_app, args)


def test_builder_accepts_cli_args():
    app = call_user_app_builder_with_args_if_necessary(build_app, {"num_workers": "2"})
    assert app is not None


def test_worker_resources():
    cpu = worker_options(AppConfig(accelerator="cpu", worker_num_cpus=2))
    assert cpu["ray_actor_options"] == {
        "num_cpus": 2.0, "runtime_env": {"env_vars": {**REPLICA_ENV, **FAST_PATH_ENV}}}
    plain = worker_options(AppConfig(accelerator="cpu", serve_fast_path=False))
    assert plain["ray_actor_options"] == {"num_cpus": 1.0,
                                          "runtime_env": {"env_vars": REPLICA_ENV}}
    assert "placement_group_bundles" not in cpu
    gpu = worker_options(AppConfig(accelerator="gpu", tensor_parallel_size=2))
    assert gpu["ray_actor_options"]["num_gpus"] == 1
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}] * 2
    assert gpu["placement_group_strategy"] == "STRICT_PACK"
    assert AppConfig(accelerator="cpu", worker_num_cpus=3).worker_threads(cores=2) == 3


@pytest.mark.parametrize("args, cores, threads", [
    ({}, 2, 2),  # the README's serve run on 2 cores: the one Worker takes both (it had 1)
    ({}, 16, 16), ({"num_workers": 2}, 16, 8), ({"num_workers": 3}, 2, 1),
    ({"autoscaling": {"min_replicas": 1, "max_replicas": 4}}, 16, 4),
    ({"num_threads": 5}, 2, 5), ({"worker_num_cpus": 4, "num_workers": 2}, 4, 4)])
def test_a_cpu_worker_takes_its_share_of_the_cores(args, cores, threads):
    assert AppConfig(accelerator="cpu", **args).worker_threads(cores=cores) == threads


@pytest.mark.parametrize("args, cpus, worker, router", [
    ({}, 2, 1.0, 0.5),  # the README's serve run on 2 cores fits as it is
    ({}, 1, 0.75, 0.25),  # on 1 core the Router was never placed: serve run waited forever
    ({"num_workers": 2}, 2, 0.75, 0.5),
    ({"num_workers": 3, "num_routers": 2}, 3, 0.75, 0.375),
    ({"tensor_parallel_size": 2}, 2, 0.75, 0.5),  # each rank reserves worker_num_cpus
    ({"autoscaling": {"min_replicas": 0, "max_replicas": 4}}, 1, 0.1875, 0.25),
    # a second Worker the policy starts on 2 cores (it waited forever, pending, at 1 CPU)
    ({"autoscaling": {"min_replicas": 1, "max_replicas": 2}}, 2, 0.75, 0.5),
    ({"num_workers": 3}, 2, 0.5, 0.5),
    # a reservation the user set stays; the default beside it takes what is left
    ({"num_workers": 2, "router_num_cpus": 0.1}, 2, 0.95, 0.1),
    ({"worker_num_cpus": 1.8}, 2, 1.8, 0.2),
    ({"num_workers": 2, "worker_num_cpus": 1}, 2, 1.0, 0.0)])
def test_default_cpu_reservations_fit_the_local_cluster(args, cpus, worker, router):
    cfg = AppConfig(accelerator="cpu", **args)
    fitted = fit_reservations(cfg, cpus)
    assert (fitted.worker_num_cpus, fitted.router_num_cpus) == (worker, router)
    assert fitted.worker_threads(cores=cpus) == cfg.worker_threads(cores=cpus)


def test_cpu_reservations_the_user_set_that_cannot_fit_are_kept_with_a_warning(monkeypatch):
    warnings: list[str] = []
    monkeypatch.setattr(serve_app.app.logger, "warning",
                        lambda msg, *args: warnings.append(msg % args))
    cfg = AppConfig(accelerator="cpu", num_workers=3, worker_num_cpus=1)
    assert fit_reservations(cfg, 2) is cfg
    assert warnings == ["3 Worker rank(s) x worker_num_cpus=1 and 1 Router(s) x "
                        "router_num_cpus=0.5 reserve 3.5 CPUs, but the local Ray cluster has 2: "
                        "Ray will not place them all and the app will wait for them"]


def test_the_local_cluster_is_the_one_serve_run_would_start(monkeypatch):
    from ray._private import services, utils

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if services.find_gcs_addresses():
        pytest.skip("a Ray cluster runs on this machine: serve run would join it")
    assert local_cluster_cpus() == float(utils.get_num_cpus())
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # serve run would join that cluster
    assert local_cluster_cpus() is None


def test_build_app_fits_the_replicas_to_the_cluster_it_starts(monkeypatch):
    monkeypatch.setattr(serve_app.app, "local_cluster_cpus", lambda: 1.0)
    router = build_app({"accelerator": "cpu"})._bound_deployment
    worker = router.init_args[0]._bound_deployment
    assert (router.ray_actor_options["num_cpus"], worker.ray_actor_options["num_cpus"]) == (
        0.25, 0.75)
    monkeypatch.setattr(serve_app.app, "local_cluster_cpus", lambda: None)  # a running cluster
    router = build_app({"accelerator": "cpu", "num_workers": 4})._bound_deployment
    assert router.init_args[0]._bound_deployment.ray_actor_options["num_cpus"] == 1.0


@pytest.mark.parametrize("given, expected", [
    ({}, {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
          "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2", "RAY_SERVE_PROXY_USE_GRPC": "1",
          "RAY_SERVE_HAPROXY_NBTHREAD": "2"}),
    # a choice of the user's wins, and keeps Serve's proxy whole (no direct ingress beside it)
    ({"RAY_SERVE_ENABLE_HA_PROXY": "0"},
     {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_PROXY_USE_GRPC": "1",
      "RAY_SERVE_HAPROXY_NBTHREAD": "2"}),
    ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_PROXY_USE_GRPC": "0",
      "RAY_SERVE_HAPROXY_NBTHREAD": "8"},
     {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0", "RAY_SERVE_PROXY_USE_GRPC": "0",
      "RAY_SERVE_HAPROXY_NBTHREAD": "8"}),
])
def test_fast_ingress_defaults(given, expected):
    env = dict(given)
    use_fast_ingress(env, cpus=8)
    assert env == expected


@pytest.mark.parametrize("cpus, threads", [(1, "1"), (2, "1"), (7, "1"), (8, "2"), (16, "4"),
                                           (96, "4")])
def test_haproxy_threads_follow_the_cpus(cpus, threads):
    env: dict[str, str] = {}
    use_fast_ingress(env, cpus=cpus)
    assert env["RAY_SERVE_HAPROXY_NBTHREAD"] == threads


def test_replicas_run_at_normal_priority_unless_told():
    env: dict[str, str] = {}
    serve_at_normal_priority(env)
    assert env == {"RAY_worker_niceness": "0"}
    env = {"RAY_worker_niceness": "10"}
    serve_at_normal_priority(env)
    assert env == {"RAY_worker_niceness": "10"}


def test_serve_config_file_matches_rays_schema():
    data = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    (app,) = schema.applications
    assert app.import_path == "serve_app:build_app"
    AppConfig.model_validate(app.args)
    call_user_app_builder_with_args_if_necessary(build_app, app.args)
    env = schema.controller_options.runtime_env["env_vars"]  # Serve's processes inherit it
    assert env == {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
                   "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


# ---- protocol --------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "hi", "max_tokens": 5', None),
    (b'{"prompt": "hi", "max_tokens": "5"}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
    (b'{"prompt": "hi", "temperature": 9}', "temperature"),
    (b'{"max_tokens": 3}', "prompt"),
    (b'{"prompt": "hi", "logit_bias": {"x1": 2.0}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"-1": 2.0}}', "logit_bias"),
    (b'{"prompt": "hi", "logit_bias": {"1": 100.5}}', "logit_bias.1"),
    (b'{"prompt": "hi", "logit_bias": {"1": "2"}}', "logit_bias.1"),
    (b'{"prompt": "hi", "stop": [""]}', None),
])
def test_completion_request_errors_are_400(body, param):
    with pytest.raises(APIError) as err:
        parse_request(CompletionRequest, body)
    assert err.value.status == 400
    assert err.value.body()["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert err.value.param == param


def test_logit_bias_keys_become_token_ids():
    req = parse_request(CompletionRequest, b'{"prompt": "hi", "logit_bias": {"17": -100, '
                                           b'"0": 2.5, "2147483647": 100}}')
    assert req.logit_bias_ids() == {17: -100.0, 0: 2.5, 2147483647: 100.0}
    assert parse_request(CompletionRequest, b'{"prompt": "hi"}').logit_bias_ids() is None


def test_a_nested_check_names_its_field_once():
    with pytest.raises(APIError) as err:
        parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], '
                                             b'"response_format": {"type": "json_schema"}}')
    assert err.value.param == "response_format.json_schema"
    assert err.value.body()["error"]["message"].startswith(
        "response_format.json_schema: is required when type is 'json_schema'")


def test_chat_content_parts_other_than_text_are_named():
    body = (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
            b'{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}')
    with pytest.raises(APIError) as err:
        parse_request(ChatCompletionRequest, body)
    assert (err.value.status, err.value.param) == (400, "messages.0.content")
    assert "only text parts are supported (a text model), got parts of type 'image_url'" in \
        err.value.message
    ok = parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": '
                                              b'[{"type": "text", "text": "a"}, {"type": "text", '
                                              b'"text": "b"}]}]}')
    assert ok.messages[0].text() == "ab"


def test_chat_request_rejects_unknown_role():
    with pytest.raises(APIError) as err:
        parse_request(ChatCompletionRequest, b'{"messages": [{"role": "wizard", "content": "x"}]}')
    assert err.value.status == 400
    assert err.value.param == "messages.0.role"


def test_prompt_forms():
    def prompts(p):
        return parse_request(CompletionRequest, f'{{"prompt": {p}}}'.encode()).prompts()

    assert prompts('"a"') == ["a"]
    assert prompts('["a", "b"]') == ["a", "b"]
    assert prompts("[1, 2]") == [[1, 2]]
    assert prompts("[[1], [2, 3]]") == [[1], [2, 3]]


def test_api_key_file_is_read_and_checked(tmp_path):
    from serve_app.config import AppConfig

    key_file = tmp_path / "api-key"
    key_file.write_text("  s3cret\n")
    assert AppConfig(api_key_file=str(key_file)).resolved_api_key() == "s3cret"
    assert AppConfig(api_key="abc").resolved_api_key() == "abc"
    assert AppConfig().resolved_api_key() is None
    with pytest.raises(ValueError, match="mutually exclusive"):
        AppConfig(api_key="abc", api_key_file=str(key_file))
    with pytest.raises(ValueError, match="cannot be read"):
        AppConfig(api_key_file=str(tmp_path / "missing")).resolved_api_key()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        AppConfig(api_key_file=str(tmp_path / "empty")).resolved_api_key()
