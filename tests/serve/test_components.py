"""The serving layer's parts without a Ray cluster: config, protocol, batcher, request router,
response streams, and the Serve config file against Ray's own schema."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.schema import ServeDeploySchema

from engine.sampling_params import SamplingParams
from serve_app.app import FAST_PATH_ENV, build_app, worker_options
from serve_app.batcher import Batch, DynamicBatcher, EngineRequest, fan_out
from serve_app.config import AppConfig
from serve_app.errors import APIError
from serve_app.ingress import serve_at_normal_priority, use_fast_ingress
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from serve_app.request_router import WorkerRequestRouter, prefix_hashes
from serve_app.streams import ResponseStream

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
    assert cpu["ray_actor_options"] == {"num_cpus": 2.0,
                                        "runtime_env": {"env_vars": FAST_PATH_ENV}}
    plain = worker_options(AppConfig(accelerator="cpu", serve_fast_path=False))
    assert plain["ray_actor_options"] == {"num_cpus": 1.0}
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
    (b'{"prompt": "hi", "logit_bias": {"1": 2.0}}', None),
    (b'{"prompt": "hi", "stop": [""]}', None),
])
def test_completion_request_errors_are_400(body, param):
    with pytest.raises(APIError) as err:
        parse_request(CompletionRequest, body)
    assert err.value.status == 400
    assert err.value.body()["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert err.value.param == param


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


# ---- batcher ---------------------------------------------------------------------------------

def _req(n_tokens: int = 4) -> EngineRequest:
    return EngineRequest(list(range(n_tokens)), SamplingParams(max_tokens=2))


def test_batcher_flushes_when_idle_on_size_on_time_and_when_routed():
    async def run():
        sent: list[Batch] = []

        async def send(batch: Batch) -> None:  # a Worker that answers when the test says so
            sent.append(batch)
            await asyncio.sleep(3600)

        def sizes() -> list[int]:
            return [len(b.requests) for b in sent]

        def route(i: int) -> None:
            sent[i].mark_routed("replica-a")

        b = DynamicBatcher(send, max_batch_size=3, batch_wait_s=0.05)
        b.submit(_req())
        await asyncio.sleep(0)
        assert sizes() == [1]  # nothing on its way: sent at once, alone
        for _ in range(4):
            b.submit(_req())
        await asyncio.sleep(0)
        assert sizes() == [1, 3]  # waited for the first; a full batch goes at once
        await asyncio.sleep(0.1)
        assert sizes() == [1, 3, 1]  # the last one waited batch_wait_s
        b.submit(_req())
        b.submit(_req())
        await asyncio.sleep(0.01)
        assert sizes() == [1, 3, 1]  # three batches on their way
        route(0)
        route(1)
        await asyncio.sleep(0)
        assert sizes() == [1, 3, 1]
        route(2)  # the last one routed: what waited goes now, before its timer
        await asyncio.sleep(0.001)
        assert sizes() == [1, 3, 1, 2]
        per_request = DynamicBatcher(send, max_batch_size=1, batch_wait_s=0.0)
        per_request.submit(_req())
        per_request.submit(_req())
        await asyncio.sleep(0)
        assert sizes() == [1, 3, 1, 2, 1, 1]
        route(3)
        await asyncio.sleep(0.001)  # nothing on its way now
        b.submit(*[_req() for _ in range(5)])  # one HTTP request's prompts: not one alone first
        await asyncio.sleep(0)
        assert sizes() == [1, 3, 1, 2, 1, 1, 3, 2]
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    asyncio.run(run())


def test_fan_out_routes_step_messages_to_requests():
    async def run():
        reqs = [_req(), _req()]
        batch = Batch(reqs)

        async def messages():
            yield {"replica": "r1"}
            yield {"t": [[0, 0, [5], None, None], [1, 0, [6, 7], "length", None]],
                   "done": [[1, 4, 0]]}
            yield {"t": [[0, 0, [8], "stop", None]], "done": [[0, 4, 0]]}

        await fan_out(batch, messages())
        assert all(r.replica == "r1" and r.finished for r in reqs)
        got0 = [reqs[0].events.get_nowait()[1] for _ in range(3)]
        assert got0 == [("t", 0, [5], None, None), ("t", 0, [8], "stop", None),
                        ("done", 4, 0)]
        assert reqs[1].events.get_nowait()[1] == ("t", 0, [6, 7], "length", None)

    asyncio.run(run())


# ---- response stream: stop strings -----------------------------------------------------------

def test_stop_string_cuts_text_and_releases_the_request():
    from transformers import AutoTokenizer

    from engine.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    ids = tok("The quick brown fox jumps", add_special_tokens=False).input_ids

    async def run():
        r = _req()
        released = []
        stream = ResponseStream([r], tok, stop=[" brown"], include_stop_str_in_output=False,
                                skip_special_tokens=True, num_logprobs=None,
                                release=released.append)
        for t in ids:
            r.events.put_nowait((r, ("t", 0, [t], None, None)))
        r.events.put_nowait((r, ("done", 4, 0)))
        text, finish = "", None
        async for deltas in stream.deltas():
            for d in deltas:
                text += d.text
                finish = d.finish_reason or finish
        return text, finish, released

    text, finish, released = asyncio.run(run())
    assert text == "The quick"
    assert finish == "stop"
    assert len(released) == 1


# ---- request router --------------------------------------------------------------------------

def _router(**kwargs) -> WorkerRequestRouter:
    r = WorkerRequestRouter(deployment_id=DeploymentID(name="WorkerTest", app_name="t"),
                            handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**{"prefix_chunk_tokens": 4, "prefix_min_match_tokens": 8,
                          "imbalance_threshold": 4, **kwargs})
    return r


def _replica(uid: str, running: int = 0, waiting: int = 0, free: int = 100):
    return SimpleNamespace(
        replica_id=ReplicaID(uid, DeploymentID(name="WorkerTest", app_name="t")),
        routing_stats={"num_running": running, "num_waiting": waiting, "num_free_blocks": free,
                       "num_total_blocks": 100},
        max_ongoing_requests=100)


def _pending(**kwargs):
    return SimpleNamespace(args=[], kwargs=kwargs, routing_context=SimpleNamespace())


def _choose(router, replicas, pending):
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [r.replica_id.unique_id for rank in ranks for r in rank]


def test_least_loaded_by_queue_then_free_blocks():
    router = _router()
    a, b, c = _replica("a", running=4, waiting=2), _replica("b", running=3), \
        _replica("c", running=3, free=10)
    assert _choose(router, [a, b, c], _pending(requests=[1])) == ["b", "c", "a"]


def test_control_call_goes_to_the_named_replica():
    router = _router()
    a, b = _replica("a"), _replica("b", running=50)
    assert _choose(router, [a, b], _pending(request_ids=["r"], target_replica="b")) == ["b"]


def test_sent_batches_count_until_a_report_has_received_them():
    router = _router()
    a, b = _replica("a"), _replica("b", running=1)
    router.on_request_routed(_pending(requests=[1, 2, 3], stream_key="k"), a.replica_id, None)
    assert router.load(a) == 3
    assert _choose(router, [a, b], _pending(requests=[1])) == ["b", "a"]
    # a report taken while the batch was in transit (after it was sent, without it) counts it
    a.routing_stats.update(received={"k": 0})
    assert router.load(a) == 3
    # another Router's requests at the replica do not cover ours
    a.routing_stats.update(received={"other": 3, "k": 1}, num_running=1)
    assert router.load(a) == 1 + 2
    a.routing_stats.update(received={"k": 3}, num_running=0)  # received, and done
    assert router.load(a) == 0
    assert _choose(router, [a, b], _pending(requests=[1])) == ["a", "b"]


def test_prefix_affinity_unless_much_busier():
    router = _router()
    a, b = _replica("a"), _replica("b")
    prompt = list(range(40))
    hashes = [prefix_hashes(prompt, 4)]
    router.on_request_routed(_pending(requests=[1], prefix_hashes=hashes, stream_key="k"),
                             b.replica_id, None)
    b.routing_stats["received"] = {"k": 1}
    a.routing_stats["num_running"] = 1  # b would win on load alone anyway: make a lighter
    b.routing_stats["num_running"] = 3
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=hashes))[0] == "b"
    other = [prefix_hashes(list(range(100, 140)), 4)]
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=other))[0] == "a"
    b.routing_stats["num_running"] = 10  # much busier than a (threshold 4)
    assert _choose(router, [a, b], _pending(requests=[1], prefix_hashes=hashes))[0] == "a"


def test_prefix_hashes_are_chained_and_skip_the_last_token():
    assert len(prefix_hashes(list(range(9)), 4)) == 2
    assert len(prefix_hashes(list(range(8)), 4)) == 1  # the last token is never covered
    x, y = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert x[1] != y[1]  # a different first chunk changes every later hash


# ---- worker client: leaving early ------------------------------------------------------------

class _FakeCall:
    def __init__(self, log, name, kwargs):
        log.append((name, kwargs))

    def __await__(self):
        return asyncio.sleep(0, result=1).__await__()

    def cancel(self):
        pass


class _FakeHandle:
    def __init__(self):
        self.calls: list = []

    def options(self, **_):
        return self

    def __getattr__(self, name):
        log = self.calls
        return SimpleNamespace(remote=lambda **kw: _FakeCall(log, name, kw))


def test_leaving_early_aborts_at_the_replica_or_cancels_the_batch():
    """A routed request is aborted at its replica (its stream may carry other batches'
    requests, so the call is never cancelled for it); a batch not at a Worker yet whose
    clients all left is dropped by cancelling its call."""
    from serve_app.worker_client import WorkerClient

    async def run():
        handle = _FakeHandle()
        client = WorkerClient(handle)
        a, b = _req(), _req()
        batch = Batch([a, b], task=asyncio.get_running_loop().create_task(asyncio.sleep(10)))
        for r in (a, b):
            r.batch, r.replica = batch, "rep-7"
        client.release(a)
        client.release(b)
        await asyncio.sleep(0.01)
        assert handle.calls == [
            ("abort", {"request_ids": [a.request_id], "target_replica": "rep-7"}),
            ("abort", {"request_ids": [b.request_id], "target_replica": "rep-7"})]
        assert not batch.task.done()
        c, d = _req(), _req()
        unrouted = Batch([c, d], task=asyncio.get_running_loop().create_task(asyncio.sleep(10)))
        c.batch = d.batch = unrouted
        client.release(c)  # d still listens: nothing to do yet
        await asyncio.sleep(0)
        assert not unrouted.task.done()
        client.release(d)  # nobody listens and nothing reached a Worker: drop the call
        await asyncio.sleep(0)
        assert unrouted.task.cancelled() and len(handle.calls) == 2
        batch.task.cancel()

    asyncio.run(run())


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
